"""The one counted door: every collective outside autograd goes through here, and the mappings build on it.

Three things live here so that nothing else writes them:
- `ring_bytes(op, num_bytes, n)`: the bytes one rank sends with the ring algorithm on n ranks, the
  formula behind every `comm/<axis>_bytes` figure (and the planner's predictions).
- `split_sizes` / `chunk_bounds` / `own_chunk`: how a length is split over the ranks of an axis
  (torch.tensor_split's convention: with L = q*n + r, the first r ranks hold q+1 elements).
- Counted collectives on an `AxisGroup`: `all_reduce` (a new tensor, traceable by torch.compile, used by
  the mappings and the vocab-parallel loss), `all_reduce_` (in place, for gradients and metrics),
  `all_reduce_coalesced_` (many tensors, one flat buffer), `all_gather`/`reduce_scatter` along a dim
  with padding for uneven splits (gloo has no all-gatherv; on gloo a reduce-scatter runs as an
  all-reduce that keeps this rank's chunk, cheaper there: `reduce_scatter_via`), `broadcast_object` (a small picklable
  decision of one rank, e.g. which checkpoint to resume), `broadcast_` and `barrier`.
- `send`/`recv`: blocking point-to-point (the pipeline's forward-only pass for validation; training
  steps use torch.distributed.pipelining's own send/recv, counted by distributed/pipeline/stages.py).
- `ring_shift`: point-to-point, every rank sends to the next rank of the axis and receives from the
  previous one, asynchronously (ring attention passes K/V blocks with it while it computes).
- `all_to_all`: chunk j of a dim to rank j, the chunks from every rank concatenated along another dim
  (all-to-all context parallelism turns sequence shards into head shards with it, and back).

A size-1 axis moves nothing and calls nothing. Byte counts go through `distributed.counting.record`.
The traceable ones run the functional collectives (`torch.distributed._functional_collectives`) while
torch.compile traces them (no graph breaks) and c10d on a fresh buffer in eager code (less CPU per call);
the in-place ones use the c10d API for buffers outside autograd (gradients, scaler flags, metrics).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from distributed.counting import record
from utils.comm import AxisGroup

# Recent torch renamed the dim-aware funcol collectives (the old names warn); older releases lack the new ones.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

# torch 2.13 renamed c10d's single-tensor all-gather and reduce-scatter (the old names warn)
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def ring_bytes(op: str, num_bytes: int, n: int) -> int:
    """Bytes one rank sends in a ring collective over n ranks.

    `num_bytes` is the size of the reduced tensor for 'all_reduce' (2(n-1)/n of it), of the full
    (gathered) buffer for 'all_gather' and of the full input for 'reduce_scatter' ((n-1)/n of it).
    """
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op]
    return factor * (n - 1) * num_bytes // n


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def split_sizes(length: int, parts: int) -> list[int]:
    """Per-rank lengths of `length` split over `parts` ranks, as `torch.tensor_split` does."""
    base, extra = divmod(length, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def chunk_bounds(length: int, axis: AxisGroup) -> tuple[int, int]:
    """[start, end) of this rank's chunk of `length` elements split over `axis`."""
    sizes = split_sizes(length, axis.size)
    start = sum(sizes[: axis.rank])
    return start, start + sizes[axis.rank]


def own_chunk(x: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (a view; no communication)."""
    start, end = chunk_bounds(x.shape[dim], axis)
    return x.narrow(dim, start, end - start)


def wait(x: torch.Tensor) -> torch.Tensor:
    """Materialize a functional collective's result (eager mode returns an AsyncCollectiveTensor)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


_issuing = 0  # > 0 while a collective of this module runs its c10d call


def issuing() -> bool:
    """Whether a collective of this module is in its c10d call now: the planner counts the c10d calls of
    FSDP2, whose bytes no counter holds, and leaves these out (they are counted: utils/plan/step.py)."""
    return _issuing > 0


def _c10d(call: Callable, /, *args, **kwargs) -> None:
    """`call(*args, **kwargs)`, a c10d collective of this module's (see `issuing`)."""
    global _issuing
    _issuing += 1
    try:
        call(*args, **kwargs)
    finally:
        _issuing -= 1


def _traced() -> bool:
    """Inside torch.compile's tracing: the functional collectives, which trace without graph breaks. Eager code
    calls c10d on a fresh output buffer instead: the same collective without the functional op's Python
    dispatch (a custom op, its autograd wrapper, an AsyncCollectiveTensor, a wait), which is most of a small
    collective's CPU on gloo (docs/measurements.md)."""
    return torch.compiler.is_compiling()


def _gathered(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(n, *x.shape): every rank's `x` in rank order (eager c10d)."""
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # gloo wants the ranks' tensors end to end along dim 0
    _c10d(_all_gather_base, out, x, group=group)
    return out.view(n, *x.shape)


def all_reduce(x: torch.Tensor, axis: AxisGroup, op: str = "sum") -> torch.Tensor:
    """A new tensor: `x` reduced over `axis` (op: sum | max | min); traceable, not differentiable."""
    if axis.size == 1:
        return x
    record(axis, ring_bytes("all_reduce", nbytes(x), axis.size))
    if _traced():
        return wait(funcol.all_reduce(x.contiguous(), op, axis.group))
    out = x.detach().clone(memory_format=torch.contiguous_format)
    _c10d(dist.all_reduce, out, op=_REDUCE_OPS[op], group=axis.group)
    return out


def all_reduce_(x: torch.Tensor, axis: AxisGroup, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over `axis` in place (gradients, flags, metric sums) and return it."""
    if axis.size > 1:
        record(axis, ring_bytes("all_reduce", nbytes(x), axis.size))
        dist.all_reduce(x, op=_REDUCE_OPS[op], group=axis.group)
    return x


def all_reduce_coalesced_(tensors: Sequence[torch.Tensor], axis: AxisGroup) -> None:
    """Sum `tensors` (one dtype) over `axis` in place through one flat buffer: one collective, not many."""
    if axis.size == 1 or not tensors:
        return
    flat = all_reduce_(torch.cat([t.reshape(-1) for t in tensors]), axis)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def mean_over(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """The mean of `x` over the ranks of `axis` (a new tensor; `x` itself at size 1)."""
    if axis.size == 1:
        return x
    return all_reduce_(x.clone(), axis).div_(axis.size)


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """Zero-pad `x` along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = missing
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def all_gather(x: torch.Tensor, axis: AxisGroup, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's chunk along `dim` (rank r holds `sizes[r]`); traceable.

    Uneven chunks are padded to the longest one and trimmed after the collective.
    """
    n, longest = axis.size, max(sizes)
    padded = _pad_to(x, dim, longest).contiguous()
    record(axis, ring_bytes("all_gather", n * nbytes(padded), n))
    if _traced():
        gathered = wait(_all_gather_single(padded, dim, axis.group))  # (..., n * longest, ...)
    else:
        stacked = _gathered(padded.detach(), axis.group, n)
        gathered = stacked.flatten(0, 1) if dim == 0 else torch.cat(stacked.unbind(0), dim=dim)
    if all(s == longest for s in sizes):
        return gathered
    return torch.cat([gathered.narrow(dim, r * longest, s) for r, s in enumerate(sizes)], dim=dim)


REDUCE_SCATTER_VIA = ("reduce_scatter", "all_reduce")


def reduce_scatter_via(axis: AxisGroup) -> str:
    """How `reduce_scatter` runs on `axis`: 'all_reduce' (sum the whole tensor, keep this rank's chunk) on
    gloo, whose reduce-scatter costs more than its all-reduce of the same tensor at activation sizes
    (docs/measurements.md), 'reduce_scatter' elsewhere (NCCL: Megatron's schedule, half the bytes)."""
    return "all_reduce" if axis.group is not None and dist.get_backend(axis.group) == "gloo" else "reduce_scatter"


def reduce_scatter(x: torch.Tensor, axis: AxisGroup, dim: int, via: str | None = None) -> torch.Tensor:
    """Sum `x` over `axis` and keep this rank's chunk along `dim` (split_sizes convention); traceable.

    `via`: 'reduce_scatter' (a reduce-scatter: (n-1)/n of x's bytes sent) or 'all_reduce' (an all-reduce,
    then this rank's chunk: 2(n-1)/n of x's bytes, no padding for uneven splits); None: `reduce_scatter_via`
    of the axis' backend. Both give the same values; each counts the bytes it sends.
    """
    via = reduce_scatter_via(axis) if via is None else via
    assert via in REDUCE_SCATTER_VIA, f"unknown reduce-scatter path {via!r}"
    n = axis.size
    if via == "all_reduce":
        total = all_reduce(x, axis)  # counted: 2(n-1)/n x bytes(x)
        return own_chunk(total, axis, dim).contiguous()
    sizes = split_sizes(x.shape[dim], n)
    longest = max(sizes)
    if any(s != longest for s in sizes):
        x = torch.cat([_pad_to(c, dim, longest) for c in x.tensor_split(n, dim=dim)], dim=dim)
    x = x.contiguous()
    record(axis, ring_bytes("reduce_scatter", nbytes(x), n))
    if _traced():
        out = wait(_reduce_scatter_single(x, "sum", dim, axis.group))  # (..., longest, ...)
    else:
        rows = x.detach().movedim(dim, 0).contiguous()  # rank r's chunk: rows r*longest ... (r+1)*longest - 1
        out = rows.new_empty((longest, *rows.shape[1:]))
        _c10d(_reduce_scatter_base, out, rows, group=axis.group)
        out = out.movedim(0, dim).contiguous()  # as the functional collective returns it
    return out.narrow(dim, 0, sizes[axis.rank])


def all_to_all(x: torch.Tensor, axis: AxisGroup, scatter_dim: int, gather_dim: int,
               scatter_sizes: Sequence[int], gather_sizes: Sequence[int]) -> torch.Tensor:
    """Send chunk j of `x` along `scatter_dim` (lengths `scatter_sizes`) to rank j; return the chunks received
    from every rank concatenated along `gather_dim` in rank order (rank j's is `gather_sizes[j]` long there);
    traceable. Uneven chunks are padded to the longest (gloo has no all-to-all-v) and trimmed after.
    Counted: the (n-1)/n of the padded buffer this rank sends to the others."""
    n = axis.size
    send_len, recv_len = max(scatter_sizes), max(gather_sizes)
    if scatter_dim == gather_dim == 0 and len({*scatter_sizes, *gather_sizes}) == 1:  # even, dim 0: views only
        buffer = x.contiguous().unflatten(0, (n, send_len))  # (n, k, ...): chunk j goes to rank j
        record(axis, (n - 1) * nbytes(buffer) // n)
        return _exchanged(buffer, axis).flatten(0, 1)
    chunks = [_pad_to(_pad_to(c, scatter_dim, send_len), gather_dim, recv_len)
              for c in x.split(list(scatter_sizes), dim=scatter_dim)]
    buffer = torch.stack(chunks).contiguous()  # (n, ...): chunk j goes to rank j
    record(axis, (n - 1) * nbytes(buffer) // n)
    received = _exchanged(buffer, axis)  # (n, ...): from rank j
    parts = [received[j].narrow(scatter_dim, 0, scatter_sizes[axis.rank]).narrow(gather_dim, 0, gather_sizes[j])
             for j in range(n)]
    return torch.cat(parts, dim=gather_dim)


def _exchanged(buffer: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Chunk j of `buffer` (its dim 0) sent to rank j, chunk j of the result received from rank j."""
    if _traced():
        return wait(funcol.all_to_all_single(buffer, None, None, axis.group))
    out = torch.empty_like(buffer)
    _c10d(dist.all_to_all_single, out, buffer.detach(), group=axis.group)
    return out


def barrier(axis: AxisGroup) -> None:
    """Wait until every rank of `axis` arrives (moves no payload bytes)."""
    if axis.size > 1:
        dist.barrier(group=axis.group)


def gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's `obj` (small picklable metadata), on every rank of a process group outside the grid's
    axes (the background checkpoint group's save plans): not counted in comm/<axis>_bytes, which count the
    grid's axes."""
    objects: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def broadcast_object(obj: Any, axis: AxisGroup, src_rank: int = 0) -> Any:
    """`obj` as rank `src_rank` of `axis` holds it (a small picklable value), on every rank of `axis`."""
    if axis.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=axis.ranks[src_rank], group=axis.group)
    if axis.rank == src_rank:  # the pickled payload and its length, sent down a tree
        record(axis, len(pickle.dumps(obj)) + 8)
    return box[0]


def broadcast_(x: torch.Tensor, axis: AxisGroup, src_rank: int) -> torch.Tensor:
    """`x` as rank `src_rank` of `axis` holds it, in place on every rank of `axis` (same shape and dtype
    everywhere). Counted on the source: the bytes of `x` (a tree sends each byte once per receiver
    group; the figure is what the source puts on the wire for one receiver)."""
    if axis.size > 1:
        if axis.rank == src_rank:
            record(axis, nbytes(x))
        dist.broadcast(x, src=axis.ranks[src_rank], group=axis.group)
    return x


def send(x: torch.Tensor, axis: AxisGroup, dst_rank: int) -> None:
    """Send `x` to rank `dst_rank` of `axis` (blocking until it is handed over); counted."""
    record(axis, nbytes(x))
    dist.send(x.contiguous(), dst=axis.ranks[dst_rank], group=axis.group)


def recv(shape: Sequence[int], dtype: torch.dtype, device: torch.device, axis: AxisGroup,
         src_rank: int) -> torch.Tensor:
    """A tensor of `shape` received from rank `src_rank` of `axis` (its sender counts the bytes)."""
    x = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(x, src=axis.ranks[src_rank], group=axis.group)
    return x


def ring_shift(tensors: Sequence[torch.Tensor], axis: AxisGroup, shapes: Sequence[Sequence[int]],
               tag: int = 0) -> Callable[[], list[torch.Tensor]]:
    """Start passing `tensors` one step around the ring of `axis`; returns `wait`, which yields what arrived.

    Every rank sends its tensors to the next rank of the axis ((rank+1) % size) and receives, from the
    previous one, tensors of `shapes` (same dtypes and device as `tensors`). The transfer runs while the
    caller computes (double buffering: compute on the current block, the next one is in flight); call
    `wait()` before using what arrived, and leave `tensors` unmodified until then. Tensor i travels
    with tag `tag + i`, so two shifts in flight at once (e.g. K/V and dK/dV) need disjoint tags; every
    rank must start the shifts of an axis in the same order. Counted: the bytes of `tensors`. A size-1
    axis moves nothing: `wait()` returns `tensors` themselves.
    """
    if axis.size == 1:
        return lambda: list(tensors)
    send_to = axis.ranks[(axis.rank + 1) % axis.size]
    recv_from = axis.ranks[(axis.rank - 1) % axis.size]
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty(tuple(s), dtype=t.dtype, device=t.device) for t, s in zip(sent, shapes, strict=True)]
    ops = [dist.P2POp(dist.isend, t, send_to, axis.group, tag + i) for i, t in enumerate(sent)]
    ops += [dist.P2POp(dist.irecv, t, recv_from, axis.group, tag + i) for i, t in enumerate(received)]
    record(axis, sum(nbytes(t) for t in sent))
    works = dist.batch_isend_irecv(ops)

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return received

    return wait
