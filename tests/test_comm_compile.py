"""Byte counting inside torch.compile: compiled blocks record exactly the bytes eager blocks record.

A 2-block GPT (7 tokens, an uneven sequence split under SP; 8 in the inductor case, whose two ranks then compile
the same kernels and the second loads them from inductor's on-disk cache) is parallelized at tp=2 on gloo. One
training step (loss, backward) counts the tp bytes after the forward and after the backward; the eager model
gives the reference. Its blocks are then compiled (a) by the trainer's path with both wrappers,
`wrap_blocks(checkpoint=True, compile=True)` with the default inductor backend, with sequence parallelism
(all-gather / reduce-scatter mappings): the compiled recomputation re-runs the collectives but counts none of
them again, and every parameter gradient equals the eager step's (the suite's one inductor-compiled parallel
block; tests/test_compile.py traces with aot_eager), and (b) with backend="aot_eager" and fullgraph=True
without sequence parallelism (copy / all-reduce mappings). For each, over
two steps with `grid.reset_comm_bytes()` in between: forward bytes and forward+backward bytes equal eager (so
the autograd Functions' compiled backward counts too), and the second step compiles nothing new. Two blocks, and
the eager vocab-parallel loss between the compiled forward and backward, catch a counter whose backward
increment is computed from a value saved at forward time. (b) also checks that each block traces into one graph
without a graph break (fullgraph=True raises at a break; both blocks share the one graph), and that a new batch
size (recompiled with a dynamic batch: byte counts are SymInts) still counts what eager counts, and that
`count_compiled(False)` (the trainer's setting on steps that do not log comm bytes) takes the counting out of
the compiled blocks without recompiling on every switch. (c) Checkpointed blocks compiled with aot_eager (the
compiled backward saves the counter with a version check): they run and count exactly what the step without
recomputation counts, forward and total, while the eager checkpointed step counts every recomputed forward
collective again (its total is larger); a compiled recomputation that counted a collective again would fail.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from distributed.block_wrappers import wrap_blocks
from distributed.counting import count_compiled
from distributed.tensor.parallelize import parallelize
from networks.transformer import GPT, GPTConfig
from tests.helpers import run_ranks
from utils.comm import Grid, init_grid
from utils.schema import ParallelConfig

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

BATCH, SEQ, EMBED, VOCAB = 2, 7, 32, 50
INDUCTOR_SEQ = 8  # an even split: both ranks compile the same kernels, the second from inductor's on-disk cache


def build_gpt(grid: Grid, sp: bool) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(embed_dim=EMBED, depth=2, num_heads=4, max_positions=16, positions="rotary")
    return parallelize(GPT(cfg, vocab_size=VOCAB), grid=grid, sequence_parallel=sp)


def batch(size: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (size, seq), generator=gen), torch.randint(0, VOCAB, (size, seq), generator=gen)


def step_bytes(model: GPT, grid: Grid, size: int = BATCH, seq: int = SEQ) -> tuple[int, int]:
    """(tp bytes after the forward, after forward + backward) of one step from a reset counter."""
    grid.reset_comm_bytes()
    loss = model.loss(*batch(size, seq))
    forward = grid.axis("tp").bytes_moved
    loss.backward()
    return forward, grid.axis("tp").bytes_moved


def plain_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by its name without the checkpoint wrapper's prefix."""
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}


def check_inductor_blocks(grid: Grid) -> None:
    """The trainer's path: wrap_blocks(checkpoint=True, compile=True), default backend, sequence parallelism on:
    eager bytes and gradients of the step without recomputation, one graph for both blocks, no recompile."""
    eager = build_gpt(grid, sp=True)
    want = step_bytes(eager, grid, seq=INDUCTOR_SEQ)
    assert 0 < want[0] < want[1], want
    torch._dynamo.reset()
    counters.clear()
    model = build_gpt(grid, sp=True)
    wrap_blocks(model, checkpoint=True, compile=True)
    assert step_bytes(model, grid, seq=INDUCTOR_SEQ) == want
    got, grads = plain_grads(model), plain_grads(eager)
    assert got.keys() == grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, grads[name], msg=lambda m: f"{name}: {m}")
    assert counters["stats"]["unique_graphs"] == 1, "the two blocks share one graph"
    assert step_bytes(model, grid, seq=INDUCTOR_SEQ) == want
    assert counters["stats"]["unique_graphs"] == 1, "the second step recompiled"


def check_aot_eager_blocks(grid: Grid) -> None:
    """Blocks compiled with aot_eager, fullgraph: one graph, eager bytes, also at a new batch size."""
    eager = build_gpt(grid, sp=False)
    want, want_new_batch = step_bytes(eager, grid), step_bytes(eager, grid, BATCH + 1)
    torch._dynamo.reset()
    model = build_gpt(grid, sp=False)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.blocks:
        block.compile(backend=counter, fullgraph=True)  # a graph break raises
    assert step_bytes(model, grid) == want
    frames = counter.frame_count
    assert frames == 1, f"{frames} graphs: the blocks share one"
    assert step_bytes(model, grid) == want
    assert counter.frame_count == frames, "the second step recompiled"
    assert step_bytes(model, grid, BATCH + 1) == want_new_batch
    check_counting_switch(model, grid, counter, want)


def check_counting_switch(model: GPT, grid: Grid, counter: CompileCounterWithBackend, want: tuple[int, int]) -> None:
    """count_compiled(False): the compiled blocks count nothing (only the eager embedding and loss do),
    each setting compiles once, and switching back counts exactly again."""
    try:
        count_compiled(False)
        off = step_bytes(model, grid)
        assert off[1] < want[1] and off[0] < want[0], (off, want)
        frames = counter.frame_count
        count_compiled(True)
        assert step_bytes(model, grid) == want
        count_compiled(False)
        assert step_bytes(model, grid) == off
        assert counter.frame_count == frames, "switching the counting back and forth recompiled"
    finally:
        count_compiled(True)


def check_checkpointed_blocks(grid: Grid) -> None:
    """Checkpointed blocks compiled with aot_eager: forward and backward bytes exactly the step's without
    recomputation, to the byte (no recomputed collective counted again), below the eager checkpointed step's,
    which counts every recomputed forward collective."""
    plain = step_bytes(build_gpt(grid, sp=True), grid)
    eager = build_gpt(grid, sp=True)
    wrap_blocks(eager, checkpoint=True, compile=False)
    want = step_bytes(eager, grid)
    torch._dynamo.reset()
    model = build_gpt(grid, sp=True)
    counter = CompileCounterWithBackend("aot_eager")
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        model.blocks[i].compile(backend=counter, fullgraph=True)
    for _ in range(2):
        forward, total = step_bytes(model, grid)
        assert (forward, total) == plain and plain[1] < want[1], (forward, total, plain, want)
    assert counter.frame_count == 1, "the second step recompiled"


def _comm_compile_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    check_aot_eager_blocks(grid)
    check_checkpointed_blocks(grid)
    check_inductor_blocks(grid)


def test_compiled_blocks_count_eager_bytes(tmp_path):
    run_ranks(_comm_compile_checks, 2, tmp_path, timeout_s=180)
