"""torch.compile through the tensor-parallel mappings: compiled blocks equal eager, in one graph.

Blocks: a ViT block (bidirectional attention) and a GPT block (causal, rotary positions: the rotary
tables are built inside forward), each taken from a 1-block model parallelized at tp=2 on gloo, with
sequence parallelism on and off. Inputs have 7 tokens, an uneven sequence split (4 + 3) under SP.
Per case, in fp32 on identical weights and inputs:
- the forward traces into exactly one graph with no graph break: `fullgraph=True` compilation (which raises
  at any break) succeeds, compiles one frame, and does not recompile on a second call (a separate
  `torch._dynamo.explain` would trace the block once more for the same verdict);
- output, input gradient and every parameter gradient of the compiled block equal the eager
  parallel block, which in turn equals the serial block (sharded gradients gathered, partial
  gradients of sequence-parallel weights summed over tp).
Backends: the cases compile with backend="aot_eager" (dynamo + AOTAutograd: where graph breaks
and the mappings' autograd.Functions are traced; inductor only generates kernels). Compiled blocks also
run under CPU bf16 autocast (bf16 collectives on gloo). The default inductor backend runs where the
trainer compiles, checkpointed blocks included (the recompute re-runs the collectives):
`wrap_blocks(checkpoint=True, compile=True)` on a tp2 GPT with SP (tests/test_comm_compile.py: bytes and
gradients of the eager step, one graph for both blocks) and serial models under `precision.compile=true`
(tests/test_precision.py). Each inductor compile of a new graph pays seconds of g++ on a fresh machine
(docs/measurements.md), so no case here repeats one of those.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from distributed.tensor.layers import TensorParallelLayer
from distributed.tensor.parallelize import parallelize
from networks.transformer import GPT, GPTConfig
from networks.vit.model import ViT, ViTConfig
from tests.helpers import run_ranks
from utils.comm import AxisGroup, init_grid
from utils.schema import ParallelConfig

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

BATCH, SEQ, EMBED, HEADS = 2, 7, 32, 4


def build_model(kind: str) -> nn.Module:
    """A small 1-block ViT ('vit', bidirectional) or rotary GPT ('gpt', causal) on fixed seeded weights."""
    torch.manual_seed(0)
    if kind == "vit":
        return ViT(ViTConfig(embed_dim=EMBED, depth=1, num_heads=HEADS, patch_size=4), (16, 32), 3, 3)
    cfg = GPTConfig(embed_dim=EMBED, depth=1, num_heads=HEADS, max_positions=16, positions="rotary")
    return GPT(cfg, vocab_size=50)


def forward_backward(block: nn.Module, params: dict[str, nn.Parameter], x: torch.Tensor, grad_out: torch.Tensor):
    """(output, input gradient, {name: parameter gradient}) of one forward/backward, nothing accumulated."""
    x = x.detach().requires_grad_(True)
    y = block(x)
    grads = torch.autograd.grad(y, [x, *params.values()], grad_out)
    return y.detach(), grads[0], dict(zip(params, grads[1:]))


def assert_same_results(got, want) -> None:
    """Output, input gradient and every parameter gradient agree (fp32 tolerances)."""
    torch.testing.assert_close(got[0], want[0], msg=lambda m: f"output: {m}")
    torch.testing.assert_close(got[1], want[1], msg=lambda m: f"input grad: {m}")
    assert got[2].keys() == want[2].keys()
    for name, grad in got[2].items():
        torch.testing.assert_close(grad, want[2][name], msg=lambda m: f"{name}: {m}")


def compiled_results(block: nn.Module, params: dict[str, nn.Parameter], x: torch.Tensor, grad_out: torch.Tensor):
    """Results of `block` compiled with fullgraph=True; a second call must not recompile."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    results = forward_backward(compiled, params, x, grad_out)
    forward_backward(block, params, x, grad_out)  # eager mappings move the byte counters in between
    assert_same_results(forward_backward(compiled, params, x, grad_out), results)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} graphs"
    return results


def full_param_grads(block: nn.Module, grads: dict[str, torch.Tensor], axis: AxisGroup) -> dict[str, torch.Tensor]:
    """Parameter gradients of a parallel block as the serial block has them: shards gathered, partials summed."""
    full = dict(grads)
    for prefix, module in block.named_modules():
        if not isinstance(module, TensorParallelLayer):
            continue
        partial = {id(p) for p in module.partial_grad_params()}
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if name in module.sharded_params:
                parts = [torch.empty_like(full[key]) for _ in range(axis.size)]
                dist.all_gather(parts, full[key].contiguous(), group=axis.group)
                full[key] = torch.cat(parts, dim=module.shard_dims[name])
            elif id(p) in partial:
                full[key] = full[key].clone()
                dist.all_reduce(full[key], group=axis.group)
    return full


def parallel_block(grid, kind: str, sp: bool):
    """(parallel block, serial block, full input, full output gradient, local view) of a 1-block model."""
    axis = grid.axis("tp")
    serial_model = build_model(kind)
    model = parallelize(copy.deepcopy(serial_model), grid=grid, sequence_parallel=sp)
    if sp:
        model.enter_seq.shards.enter(SEQ)  # what the model's entry records before its blocks run
    x = torch.randn(BATCH, SEQ, EMBED, generator=torch.Generator().manual_seed(1))
    g = torch.randn(BATCH, SEQ, EMBED, generator=torch.Generator().manual_seed(2))
    local = (lambda t: t.tensor_split(axis.size, dim=1)[axis.rank]) if sp else (lambda t: t)  # (B, N_local, D)
    return model.blocks[0], serial_model.blocks[0], x, g, local


def check_block(grid, kind: str, sp: bool) -> None:
    """Compiled parallel block == eager parallel block == serial block, in one graph."""
    block, serial, x, g, local = parallel_block(grid, kind, sp)
    params = dict(block.named_parameters())
    torch._dynamo.reset()
    eager = forward_backward(block, params, local(x), local(g))
    assert_same_results(compiled_results(block, params, local(x), local(g)), eager)
    want = forward_backward(serial, dict(serial.named_parameters()), x, g)
    torch.testing.assert_close(eager[0], local(want[0]))
    torch.testing.assert_close(eager[1], local(want[1]))
    assert_same_results((eager[0], eager[1], full_param_grads(block, eager[2], grid.axis("tp"))),
                        (eager[0], eager[1], want[2]))


def check_autocast(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Compiled `block` under CPU bf16 autocast: finite output and gradients, equal to eager autocast."""
    params = dict(block.named_parameters())
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = forward_backward(compiled, params, x, grad_out)
        want = forward_backward(block, params, x, grad_out)
    assert all(t.isfinite().all() for t in (got[0], got[1], *got[2].values()))
    assert_same_results(got, want)


def _tp_compile_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    for kind in ("vit", "gpt"):
        for sp in (False, True):
            check_block(grid, kind, sp)
    block, _, x, g, local = parallel_block(grid, "gpt", sp=True)
    check_autocast(block, local(x), local(g))  # bf16 collectives on gloo


def test_compiled_tp_blocks_match_eager_without_graph_breaks(tmp_path):
    run_ranks(_tp_compile_checks, 2, tmp_path, timeout_s=180)


def test_compiled_block_under_bf16_autocast():
    """The serial GPT block, compiled, under CPU bf16 autocast (as the trainer runs precision=bf16)."""
    torch._dynamo.reset()
    x = torch.randn(BATCH, SEQ, EMBED, generator=torch.Generator().manual_seed(1))
    g = torch.randn(BATCH, SEQ, EMBED, generator=torch.Generator().manual_seed(2))
    check_autocast(build_model("gpt").blocks[0], x, g)
