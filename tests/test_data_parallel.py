"""Data parallelism: DDP gradients equal the serial gradient of the concatenated batch, the recorded
bytes equal 2(d-1)/d x gradient bytes, no_sync accumulates, and sync_partial_grads sums over tp.

The small ViT of test_parallelize in float64; the global batch (4 samples) is split over dp ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.data_parallel import no_sync, sync_partial_grads, unwrap, wrap_data_parallel
from distributed.tensor.layers import SequenceParallelLayerNorm, TensorParallelLayer
from distributed.tensor.parallelize import parallelize
from tests.helpers import run_ranks
from tests.test_parallelize import CHANNELS, IMG, build_vit
from utils.comm import Grid, init_grid
from utils.schema import ParallelConfig

GLOBAL_BATCH = 4


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(GLOBAL_BATCH, CHANNELS, *IMG, generator=gen, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _serial_grads() -> dict[str, torch.Tensor]:
    model = build_vit()
    _loss(model, *_batch()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _local_full_grad(name: str, module_of: dict, p: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The full gradient of a parameter: gathered over tp when its layer shards it."""
    prefix, _, leaf = name.rpartition(".")
    module = module_of[prefix]
    if not isinstance(module, TensorParallelLayer) or leaf not in module.sharded_params:
        return p.grad
    axis = grid.axis("tp")
    parts = [torch.empty_like(p.grad) for _ in range(axis.size)]
    dist.all_gather(parts, p.grad, group=axis.group)
    return torch.cat(parts, dim=module.shard_dims[leaf])


def _ddp_checks(rank: int, world_size: int, tp: int) -> None:
    grid = init_grid(ParallelConfig(tp=tp))
    for accumulate in (False, True):
        _check_ddp_step(grid, world_size // tp, accumulate)
    if tp == 1:
        _check_buckets_overlap_backward(grid)


def _check_buckets_overlap_backward(grid: Grid) -> None:
    """Gradients are reduced in buckets, each launched as soon as its gradients are ready: several
    all-reduces start before backward reaches the input (the first layer's gradients come last). Eight
    0.5 MB layers (fp64), 0.5 MB buckets: one bucket per layer."""
    import distributed.data_parallel as data_parallel

    events, hook = [], data_parallel._allreduce_mean_hook

    def counted(state, bucket):
        events.append("bucket")
        return hook(state, bucket)

    data_parallel._allreduce_mean_hook = counted
    try:
        layers = nn.Sequential(*[nn.Linear(256, 256, dtype=torch.float64) for _ in range(8)])
        model = wrap_data_parallel(layers, grid=grid, bucket_cap_mb=0.5)
    finally:
        data_parallel._allreduce_mean_hook = hook
    for step in range(2):  # DDP's first step reduces one bucket at the end, then it rebuilds them in order
        events.clear()
        x = torch.randn(2, 256, dtype=torch.float64, requires_grad=True)
        x.register_hook(lambda g: events.append("input"))
        model(x).square().sum().backward()
    assert events.count("bucket") == 8 and events.index("input") == 7, events  # 7 in flight before the end


def _check_ddp_step(grid: Grid, dp: int, accumulate: bool) -> None:
    """One step of DDP (x tp with SP) against the serial gradient of the whole batch."""
    dp_axis = grid.axis("dp", "cp")
    model = wrap_data_parallel(parallelize(build_vit(), grid=grid, sequence_parallel=True), grid=grid)
    assert isinstance(model, DistributedDataParallel) and dp_axis.size == dp
    x, y = (t.tensor_split(dp_axis.size)[dp_axis.rank] for t in _batch())  # this replica's samples
    grid.reset_comm_bytes()
    if accumulate:  # two micro-batches, the first without the DDP all-reduce
        with no_sync(model):
            (_loss(model, x[:1], y[:1]) / 2).backward()
        assert dp_axis.bytes_moved == 0
        (_loss(model, x[1:], y[1:]) / 2).backward()
    else:
        _loss(model, x, y).backward()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n = dp_axis.size
    assert dp_axis.bytes_moved == 2 * (n - 1) * grad_bytes // n, (dp_axis.bytes_moved, grad_bytes)
    sync_partial_grads(model)
    reference, module_of = _serial_grads(), dict(unwrap(model).named_modules())
    for name, p in unwrap(model).named_parameters():
        torch.testing.assert_close(_local_full_grad(name, module_of, p, grid), reference[name],
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world_size,tp", [(2, 1), (4, 2)])
def test_ddp_matches_serial_batch(world_size, tp, tmp_path):
    """dp=2 alone, and dp=2 x tp=2 with sequence parallelism; each with and without accumulation."""
    run_ranks(_ddp_checks, world_size, tmp_path, tp)


def _partial_sync_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    axis = grid.axis("tp")
    norm = SequenceParallelLayerNorm(8, axis, dtype=torch.float64)
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
              for r in range(world_size)]
    norm(inputs[rank]).pow(2).sum().backward()  # each rank: its own tokens
    reference = nn.LayerNorm(8, dtype=torch.float64)
    for r in range(world_size):  # the sum over ranks, computed locally
        reference(inputs[r]).pow(2).sum().backward()
    grid.reset_comm_bytes()
    sync_partial_grads(norm)
    torch.testing.assert_close(norm.weight.grad, reference.weight.grad)
    torch.testing.assert_close(norm.bias.grad, reference.bias.grad)
    assert axis.bytes_moved == 2 * (world_size - 1) * 16 * 8 // world_size  # one flat buffer of 16 doubles


def test_sync_partial_grads_sums_over_tp(tmp_path):
    run_ranks(_partial_sync_checks, 2, tmp_path)


def test_single_replica_is_not_wrapped():
    model, grid = build_vit(), Grid.serial()
    assert wrap_data_parallel(model, grid=grid) is model
    reference = copy.deepcopy(model)
    x, y = _batch()
    with no_sync(model):
        _loss(model, x, y).backward()
    _loss(reference, x, y).backward()
    sync_partial_grads(model)  # nothing declared, size-1 axes: a no-op
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
