"""Gradient synchronization across replicas: DDP over dp x cp, and partial gradients over tp.

- `wrap_data_parallel` wraps the model in torch DDP over `grid.replicas` (dp x cp), the ranks that hold
  the same weights for every weight, with a comm hook that all-reduces each gradient bucket, divided
  by the size of `grid.batch` (dp): summed over cp (each cp rank's gradient covers only its own tokens of
  the same loss, see distributed/context/parallelize.py) and averaged over dp (each dp rank has other
  samples). It records 2(d-1)/d x bucket bytes on that axis (ring all-reduce, d = dp x cp).
- `sync_partial_grads` sums over tp the gradients that layers declare partial (`partial_grad_axes` and
  `partial_grad_params()` of `distributed/tensor/layers.py`: LayerNorms and row-parallel biases under
  sequence parallelism, whose ranks each saw only their own tokens), in one coalesced all-reduce per axis.
  Call it after the last backward of a step, before clipping and the optimizer step. `sum_grads` is its
  reduction (one flat all-reduce per dtype), shared with the pipeline's dp sync (distributed/pipeline/).
- `no_sync` skips DDP's all-reduce and FSDP's reduce-scatter for gradient-accumulation micro-batches,
  wrapped or not; the backward must run inside the block (FSDP2 reads the flag in its post-backward hook,
  DDP at forward time). `set_gradient_sync` is the same switch for the FSDP units inside a pipeline stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from distributed.collectives import all_reduce_coalesced_, nbytes, ring_bytes
from distributed.counting import record
from utils.comm import AxisGroup, Grid


def _allreduce_mean_hook(state, bucket):
    """DDP comm hook: all-reduce one flat gradient bucket (dist.GradBucket) over `axis` and divide it by
    `parts` (state = (grid.replicas, grid.batch's size)), counting its ring volume; returns a Future of the
    reduced buffer.

    Unannotated on purpose: DDP compares the annotations with dist.GradBucket and torch.futures.Future
    objects, which `from __future__ import annotations` would turn into strings.
    """
    axis, parts = state
    buffer = bucket.buffer()
    record(axis, ring_bytes("all_reduce", nbytes(buffer), axis.size))
    buffer.div_(parts)
    work = dist.all_reduce(buffer, group=axis.group, async_op=True)
    return work.get_future().then(lambda fut: buffer)  # reduced in place (also under a fake group: the planner)


def wrap_data_parallel(model: nn.Module, *, grid: Grid, bucket_cap_mb: float = 25.0) -> nn.Module:
    """DDP over grid.replicas when it has more than one rank, else `model` itself.

    Collectives: one all-reduce (mean) per gradient bucket in backward, overlapped with it. At
    construction DDP checks parameter shapes and broadcasts the weights from the group's first rank.
    Buffers are not broadcast each forward (`forward_sync_buffers=False`, torch 2.13's name for the deprecated
    `broadcast_buffers`, which warned on every rank): the models' only buffers are constant rotary tables,
    identical on every rank, and the broadcast would be uncounted traffic.
    """
    axis = grid.replicas
    if axis.size == 1:
        return model
    device = grid.device
    ddp = DistributedDataParallel(model, process_group=axis.group, bucket_cap_mb=bucket_cap_mb,
                                  device_ids=[device] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True, forward_sync_buffers=False)
    ddp.register_comm_hook((axis, grid.batch.size), _allreduce_mean_hook)  # plant: ddp_divides_by_dp_x_cp
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool = True, *, fsdp: bool = True) -> Iterator[None]:
    """Accumulate gradients locally (no DDP all-reduce, no FSDP reduce-scatter) for a forward AND its backward
    run inside the block (FSDP2 reads the flag in its post-backward hook); a no-op without either, or with `skip`
    false. FSDP then keeps each unit's unsharded gradient until the backward that syncs (the memory cost of
    reducing once per step: docs/memory.md); `fsdp` false leaves FSDP's units reducing every micro-batch
    (`parallel.fsdp_reduce_every_microbatch`: gradients stay sharded)."""
    if not skip or (isinstance(model, FSDPModule) and not fsdp):
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        set_gradient_sync(model, False)
        try:
            yield
        finally:
            set_gradient_sync(model, True)
    else:
        yield


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Whether the next backward of every FSDP unit in `module` reduce-scatters its gradient (sync) or adds it
    to the unsharded one it keeps; nothing without FSDP."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_requires_gradient_sync(sync, recurse=False)


def partial_grad_params(model: nn.Module) -> dict[str, tuple[AxisGroup, list[nn.Parameter]]]:
    """Axis name -> (the AxisGroup, parameters whose gradients are partial over it), as layers declare."""
    found: dict[str, tuple[AxisGroup, list[nn.Parameter]]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for axis in getattr(module, "partial_grad_axes", ()):
            for p in module.partial_grad_params():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.setdefault(axis.name, (axis, []))[1].append(p)
    return found


def sync_partial_grads(model: nn.Module) -> None:
    """Sum declared partial gradients over their axis: one flat all-reduce per axis (and dtype).

    Records 2(t-1)/t x bytes of the flat buffer on the axis. Parameters without a gradient are skipped.
    """
    for axis, params in partial_grad_params(unwrap(model)).values():
        # plant: partial_grads_skip_vectors (next line)
        sum_grads(params, axis)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP DTensor (same storage), else itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def sum_grads(params: list[nn.Parameter], axis: AxisGroup) -> list[torch.Tensor]:
    """Sum the gradients of `params` (those that have one) over `axis` in place, one flat all-reduce per
    dtype; returns the gradients."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        all_reduce_coalesced_([g for g in grads if g.dtype == dtype], axis)
    return grads
