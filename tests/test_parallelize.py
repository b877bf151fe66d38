"""Whole models parallelized at tp=2 and tp=4 against the serial model, communication and memory.

ViT (embed 32, depth 2, 4 heads, 16x32 image, patch 4: 32 tokens, 3 channels) and the GPT language
model (tied, padded vocabulary, 7 tokens: an uneven sequence split) are run serially and parallelized
on identical initial weights, in float64. Compared: output (or loss), input gradient and every
weight gradient, sharded gradients gathered to full size.

Communication accounting (ViT, one forward+backward, measured on the tp axis before the partial
gradient sync): the blocks move exactly depth x 8(t-1)/t x A bytes, A = batch x tokens x hidden x
bytes/element, without sequence parallelism; with it 10(t-1)/t x A per block (the column-parallel
layers gather their saved shard again in backward), or 8 with `keep_gathered`. The ViT's patch
embedding and head stay replicated (no communication); under sequence parallelism the 'enter' split
all-gathers the gradient in backward and the 'exit' gather all-gathers in forward, (t-1)/t x A each.
The sync of partial LayerNorm / row-parallel bias gradients is checked separately.

Activation memory: the bytes the blocks save for backward (saved-tensor hooks) per rank are 1/t of the
serial model's under sequence parallelism (within 2%), and more with `keep_gathered`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed.data_parallel import partial_grad_params, sync_partial_grads
from distributed.grad_norm import grad_norm
from distributed.rng import ShardedRandom
from distributed.tensor.layers import TensorParallelLayer
from distributed.tensor.parallelize import parallelize
from networks.transformer import GPT, GPTConfig
from networks.vit.model import ViT, ViTConfig
from tests.helpers import run_ranks
from utils import ConfigError
from utils.cli.config import load_config
from utils.comm import Grid, init_grid
from utils.schema import ParallelConfig

BATCH, IMG, CHANNELS, DEPTH, EMBED = 2, (16, 32), 3, 2, 32


def build_vit(num_heads: int = 4) -> ViT:
    torch.manual_seed(0)
    cfg = ViTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=num_heads, patch_size=4)
    return ViT(cfg, IMG, CHANNELS, CHANNELS).double()


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, max_positions=16), vocab_size=50).double()


def _sharding(model: nn.Module) -> dict[str, int]:
    """Parameter name -> dim split over tp, for every sharded parameter of a parallel model."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, TensorParallelLayer):
            for name in module.sharded_params:
                found[f"{prefix}.{name}" if prefix else name] = module.shard_dims[name]
    return found


def _gather(t: torch.Tensor, axis, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(axis.size)]  # the shapes below split evenly
    dist.all_gather(parts, t.contiguous(), group=axis.group)
    return torch.cat(parts, dim=dim)


def _compare_grads(serial: nn.Module, parallel: nn.Module, axis) -> None:
    """Every parameter gradient of `parallel` (gathered if sharded) equals the serial one."""
    split = _sharding(parallel)
    serial_params = dict(serial.named_parameters())
    names = [n for n, _ in parallel.named_parameters()]
    assert sorted(names) == sorted(serial_params), "parallelize changed the parameter names"
    for name, p in parallel.named_parameters():
        grad = _gather(p.grad, axis, split[name]) if name in split else p.grad
        torch.testing.assert_close(grad, serial_params[name].grad, msg=lambda m: f"{name}: {m}")


def _check_grad_norm(serial: nn.Module, parallel: nn.Module, grid: Grid) -> None:
    """The parallel model's global grad norm is the serial one (replicated weights counted once, shards
    summed over tp, a tied weight once), from one counted fp32 all-reduce of the sharded squares."""
    want = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in serial.parameters()]))
    torch.testing.assert_close(grad_norm(serial, grid=Grid.serial()), want)
    axis = grid.axis("tp")
    before = axis.bytes_moved
    torch.testing.assert_close(grad_norm(parallel, grid=grid), want)
    assert axis.bytes_moved - before == 2 * (axis.size - 1) * 4 // axis.size


def _block_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages the blocks save for backward in one forward (weights excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, saved = [False], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = [h for b in model.blocks for h in (b.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
                                               b.register_forward_hook(lambda *a: inside.__setitem__(0, False)))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    for h in hooks:
        h.remove()
    return sum(saved.values())


def _check_vit(grid: Grid, sp: bool | str) -> None:
    """sp: False, True (column-parallel layers save their shard) or 'keep' (they save the gathered input)."""
    axis, t = grid.axis("tp"), grid.size("tp")
    serial = build_vit()
    parallel = parallelize(copy.deepcopy(serial), grid=grid, sequence_parallel=bool(sp), keep_gathered=sp == "keep")
    x = torch.randn(BATCH, CHANNELS, *IMG, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = torch.randn(BATCH, CHANNELS, *IMG, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = serial(x_ref)
    y_ref.backward(g)
    grid.reset_comm_bytes()
    y = parallel(x_par)
    y.backward(g)
    activation_bytes = BATCH * serial.num_tokens() * EMBED * x.element_size()  # A
    gloo_rs = 4 * DEPTH if sp else 0  # SP's 4 reduce-scatters per block run as all-reduces on gloo: 2 units, not 1
    expected = ((10 if sp is True else 8) * DEPTH + (2 if sp else 0) + gloo_rs) * (t - 1) * activation_bytes // t
    assert axis.bytes_moved == expected, (sp, axis.bytes_moved, expected)
    ratio = _block_saved_bytes(parallel, x) / _block_saved_bytes(serial, x)
    assert abs(ratio - 1 / t) < 0.02 if sp is True else ratio > 1 / t + 0.05, (sp, ratio)
    _check_partial_sync(parallel, grid, bool(sp))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x_par.grad, x_ref.grad)
    _compare_grads(serial, parallel, axis)
    _check_grad_norm(serial, parallel, grid)
    _check_memory(serial, parallel, t)


def _check_autocast_bytes(grid: Grid) -> None:
    """Under bf16 autocast every collective of the blocks and the 'exit' gather (it feeds the head's matmul)
    move bf16: exactly half of fp32's bytes. Only the 'enter' split's backward gathers an fp32 gradient
    (the residual stream stays fp32, as in the serial model)."""
    axis, t = grid.axis("tp"), grid.size("tp")
    x = torch.randn(BATCH, CHANNELS, *IMG, generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        model = parallelize(build_vit().float(), grid=grid, sequence_parallel=sp)
        grid.reset_comm_bytes()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        a2 = BATCH * model.num_tokens() * EMBED * 2  # A in bf16
        want = (((14 * DEPTH + 1) * (t - 1) * a2 + (t - 1) * 2 * a2) // t if sp
                else 8 * DEPTH * (t - 1) * a2 // t)  # gloo
        assert axis.bytes_moved == want, (sp, axis.bytes_moved, want)


def _check_partial_sync(parallel: nn.Module, grid: Grid, sp: bool) -> None:
    """Under SP: 2 norms per block + final norm (weight, bias) and 2 row biases per block, summed."""
    axis, t = grid.axis("tp"), grid.size("tp")
    declared = partial_grad_params(parallel)
    assert set(declared) == ({"tp"} if sp else set())
    params = declared["tp"][1] if sp else []
    assert not sp or declared["tp"][0] is axis  # the grid's own AxisGroup object, not a name
    want_numel = (2 * DEPTH + 1) * 2 * EMBED + 2 * DEPTH * EMBED if sp else 0
    assert sum(p.numel() for p in params) == want_numel
    before = axis.bytes_moved
    sync_partial_grads(parallel)
    assert axis.bytes_moved - before == 2 * (t - 1) * want_numel * 8 // t


def _check_memory(serial: nn.Module, parallel: nn.Module, t: int) -> None:
    """Each rank holds 1/t of every sharded weight and all of every replicated one."""
    split = _sharding(parallel)
    serial_params = dict(serial.named_parameters())
    sharded = sum(p.numel() * p.element_size() for n, p in parallel.named_parameters() if n in split)
    replicated = sum(p.numel() * p.element_size() for n, p in parallel.named_parameters() if n not in split)
    serial_sharded = sum(serial_params[n].numel() * serial_params[n].element_size() for n in split)
    assert split and sharded * t == serial_sharded
    assert replicated == sum(p.numel() * p.element_size() for n, p in serial_params.items() if n not in split)


def _check_gpt(grid: Grid, sp: bool) -> None:
    axis = grid.axis("tp")
    serial = build_gpt()
    parallel = parallelize(copy.deepcopy(serial), grid=grid, sequence_parallel=sp)
    assert parallel.lm_head.weight is parallel.tok_embed.weight  # the tie survives
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, 50, (BATCH, 7), generator=gen), torch.randint(0, 50, (BATCH, 7), generator=gen)
    loss_ref = serial.loss(idx, targets)
    loss_ref.backward()
    loss = parallel.loss(idx, targets)
    loss.backward()
    sync_partial_grads(parallel)
    torch.testing.assert_close(loss, loss_ref)
    _compare_grads(serial, parallel, axis)
    _check_grad_norm(serial, parallel, grid)


def _check_bad_heads(grid: Grid) -> None:
    model = build_vit(num_heads=2)  # 2 heads over tp=4
    before = repr(model)
    with pytest.raises(AssertionError, match="heads"):  # a user setting is refused earlier, by Config
        parallelize(model, grid=grid, sequence_parallel=True)
    assert repr(model) == before  # untouched


def _check_dropout_streams(grid: Grid, sp: bool) -> None:
    """Dropout masks: equal across tp on replicated activations, different on sharded ones."""
    axis = grid.axis("tp")
    torch.manual_seed(0)
    model = GPT(GPTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, max_positions=16, dropout=0.5), vocab_size=50)
    model = parallelize(model, grid=grid, sequence_parallel=sp).train()
    masks: dict[str, torch.Tensor] = {}

    def record(name):
        return lambda module, args, out: masks.__setitem__(name, (out == 0) & (args[0] != 0))

    drops = {name: m for name, m in model.named_modules() if isinstance(m, nn.Dropout)}
    for name, module in drops.items():
        module.register_forward_hook(record(name))
    sharded = {name for name in drops if name.endswith(".inner")}
    assert sharded == ({f"blocks.{i}.{d}.inner" for i in range(DEPTH) for d in ("drop", "mlp.drop")} if sp else set())
    assert all(isinstance(b.attn.attend, ShardedRandom) for b in model.blocks)  # heads are always split
    torch.manual_seed(1)  # one default stream across tp, as utils.engine.build seeds it
    model.loss(torch.randint(0, 50, (BATCH, 8)), torch.randint(0, 50, (BATCH, 8)))
    for name, mask in masks.items():
        gathered = _gather(mask.int(), axis, 0).chunk(axis.size)
        same = all(torch.equal(g, gathered[0]) for g in gathered[1:])
        assert same == (name not in sharded), f"{name}: masks {'equal' if same else 'differ'} across tp"


def _parallelize_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    for sp in (False, True):
        _check_vit(grid, sp)
        _check_gpt(grid, sp)
        _check_dropout_streams(grid, sp)
    _check_vit(grid, "keep")
    _check_autocast_bytes(grid)
    if world_size == 4:
        _check_bad_heads(grid)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_models_match_serial(world_size, tmp_path):
    run_ranks(_parallelize_checks, world_size, tmp_path)


def test_tp1_returns_model_unchanged():
    model = build_vit()
    before = repr(model)
    assert parallelize(model, grid=Grid.serial(), sequence_parallel=True) is model
    assert repr(model) == before


def test_heads_must_divide_tp():
    load_config(["parallel.tp=2"])  # vit_tiny: 4 heads
    with pytest.raises(ConfigError) as err:
        load_config(["parallel.tp=3"])
    assert "model.num_heads=4" in str(err.value) and "parallel.tp=3" in str(err.value)
    assert err.value.setting == "parallel.tp"
