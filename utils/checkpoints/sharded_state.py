"""The checkpoint view of a parallel model: every tensor under its single-process name with its global
shape, written and read with torch.distributed.checkpoint (DCP), which reshards by that metadata.

`checkpoint_view(model, optimizer, grid)` maps flat keys to tensors that share storage with the live ones:

    model/<name>              every state-dict entry (parameters and persistent buffers)
    optim/<name>/<state>      Adam's moments and step count of every parameter, under each of its names

Names are the single-process model's (pipeline stages keep global block names; a tied embedding is found
under both of its names, so a pipeline's two copies and the serial model's one parameter read the same
entries). A tensor this rank holds whole (replicated over tp, a norm, a buffer, a step count) is a plain
tensor: DCP writes one copy of equal keys. A part of a tensor (split over tp, then over FSDP's replicas, evenly
or not: `distributed/placement.py`) is a `Box`, its local tensor placed in the full shape by its offsets,
and Adam's moments follow their parameter's box. A save writes each rank's boxes and a load reads into
them in place: no collective, no full-size buffer, under any layout of the save and of the load.

`save_state`/`load_state` run DCP over the whole job (`no_dist` in one process) or, for background
saves, on a dedicated group; a background save copies to host memory only what this rank writes. Checkpoint
metadata is read with an unpickler that admits only DCP's own classes: opening a checkpoint never runs code
it carries.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from distributed.collectives import gather_objects
from distributed.placement import local_pieces, parameter_names
from utils.comm import AxisGroup, Grid

# DCP warns that it assumes one process when torch.distributed is not initialized: here that is meant
# (also in the thread of a background save, hence a process-wide filter).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class Box(torch.Tensor):
    """This rank's part of a tensor for DCP: `local` = full[offsets[d] : offsets[d] + local.shape[d], ...], with
    the full tensor's shape and dtype (a storage-less wrapper: no op runs on it, only on `local`).

    DCP 2.13 asks a state-dict value that has them (the `_Checkpointable` protocol DTensor implements) for
    `__create_write_items__` (the save plan: one SHARD item at `offsets`, identical on the ranks holding the
    same box, so that the planner's dedup writes it once), `__create_chunk_list__` (the load plan: the saved
    chunks overlapping this one are read) and `__get_tensor_shard__` (the tensor a write reads or a read
    fills in place: `local`)."""

    local: torch.Tensor
    offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, full_shape: tuple[int, ...], offsets: tuple[int, ...]) -> Self:
        assert all(o + n <= f for o, n, f in zip(offsets, local.shape, full_shape, strict=True)), \
            f"box {tuple(offsets)} + {tuple(local.shape)} outside {tuple(full_shape)}"
        box = torch.Tensor._make_wrapper_subclass(cls, full_shape, dtype=local.dtype, device=local.device)
        box.local, box.offsets = local, torch.Size(offsets)
        return box

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a checkpoint Box: operate on its .local tensor")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Box(local={tuple(self.local.shape)}, offsets={tuple(self.offsets)}, full={tuple(self.shape)})"

    def slices(self) -> tuple[slice, ...]:
        """The box as slices of the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local.shape))

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        data = TensorWriteData(chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self.local),
                               size=self.shape)
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset == self.offsets, f"{index.fqn}: chunk {index.offset} asked of the box at {self.offsets}"
        # plant: box_hands_dcp_a_copy (next line)
        return self.local


@dataclass
class View:
    """Flat key -> tensor or `Box`, sharing storage with the model and optimizer."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(t.shape) for key, t in self.tensors.items()}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam's state as before its first step (zero moments, step 0): the entries a
    checkpoint holds and a load fills in place. Adam's update from it equals the one from no state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            on_device = group.get("fused") or group.get("capturable")
            step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def checkpoint_view(model: nn.Module, optimizer: torch.optim.Optimizer | None, grid: Grid, *,
                    for_load: bool) -> View:
    """The flat view of this rank's model (and optimizer) state; see the module doc. The same view serves a
    save and a load (`grid` and `for_load` are no longer needed: each tensor's box comes from the model)."""
    for module in model.modules():  # after a no-grad forward without resharding, FSDP modules hold the
        if isinstance(module, FSDPModule):  # gathered parameters: back to the sharded ones the optimizer has
            module.reshard()
    pieces, view = {id(piece.param): piece for piece in local_pieces(model)}, View()

    def add(key: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
        piece = pieces.get(id(param))
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        assert piece is not None or not isinstance(tensor, DTensor), f"{key}: a DTensor that is no parameter's"
        if piece is None or local.shape != piece.local.shape or local.shape == piece.full_shape:
            view.tensors[key] = local  # whole: a buffer, a replicated parameter, a step count
        else:
            view.tensors[key] = Box(local, piece.full_shape, piece.offsets)

    # plant: checkpoint_wrapper_names (next line)
    params = parameter_names(model)
    for name, tensor in model.state_dict(keep_vars=True).items():
        add(f"model/{name}", tensor, params.get(name, tensor))
    if optimizer is not None:
        init_optimizer_state(optimizer)
        for name, param in params.items():
            assert param in optimizer.state, f"{name} is not a parameter the optimizer updates"
            for entry, value in optimizer.state[param].items():
                add(f"optim/{name}/{entry}", value, param)
    return view


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly DCP's metadata classes, torch sizes and dtypes, and paths: nothing that runs code
    (a dotted name, which pickle would resolve attribute by attribute, is refused outright)."""

    def find_class(self, module: str, name: str):
        allowed = "." not in name and ((module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read with `_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("checkpoint metadata is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_shapes(folder: Path) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape of every tensor in a DCP checkpoint (None for non-tensor entries)."""
    metadata = SafeReader(folder).read_metadata()
    return {key: tuple(m.size) if isinstance(m, TensorStorageMetadata) else None
            for key, m in metadata.state_dict_metadata.items()}


class CheckpointIOError(RuntimeError):
    """DCP could not read or write a checkpoint; `causes`: the exceptions of the ranks that failed."""

    def __init__(self, message: str, causes: list[BaseException]):
        super().__init__(message)
        self.causes = causes


def transient(err: BaseException) -> bool:
    """An error that says nothing about the checkpoint's files: I/O (not a missing file), a timeout, a
    collective that failed. Those re-raise instead of counting as corruption."""
    if isinstance(err, OSError):
        return not isinstance(err, FileNotFoundError)
    return isinstance(err, dist.DistError)


def save_state(tensors: dict[str, torch.Tensor], folder: Path, world: AxisGroup, *,
               background: bool = False, background_group=None) -> Future | None:
    """Write `tensors` of every rank into `folder` (every rank calls). `background`: the part of `tensors`
    this rank writes (`own_share`) is copied to host memory first (`HostStager`), then written by a thread,
    coordinating on `background_group` (a gloo group of all ranks, never the one the training loop uses);
    returns, once the copy is made, the Future that completes once every rank's files and the metadata are
    written."""
    writer = dcp.FileSystemWriter(folder, sync_files=True)
    if not background:
        with _as_error("write"):
            dcp.save(tensors, storage_writer=writer, process_group=world.group, no_dist=world.size == 1)
        return None
    share = own_share(tensors, background_group if world.size > 1 else None)
    stager = HostStager(pin=any(t.device.type == "cuda" for t in share.values()))
    try:
        response = dcp.async_save(share, storage_writer=writer, process_group=background_group,
                                  no_dist=world.size == 1, async_stager=stager)
    except BaseException:
        stager.close()
        raise
    response.upload_completion.add_done_callback(lambda _: stager.close())
    response.staging_completion.result()  # the caller's next step may change the tensors
    return response.upload_completion


def own_share(tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The entries of `tensors` this rank writes: DCP's own dedup of every rank's save plan (an item several
    ranks hold, e.g. a replica's box, goes to one of them), run before a background save stages anything.
    The plans travel over `group` as in DCP's planning (metadata only, on the background group, outside the
    grid's byte count); the save's own planning then finds nothing left to dedup. None: one process."""
    if group is None:
        return tensors
    plans = gather_objects(create_default_local_save_plan(tensors, False), group)
    mine = {item.index.fqn for item in dedup_save_plans(plans)[dist.get_rank(group)].items}
    return {key: t for key, t in tensors.items() if key in mine}


class HostStager(AsyncStager):
    """Copies a state dict to host memory with DCP's DefaultStager, on its worker thread (into pinned memory,
    on a side stream, when `pin`: the tensors are on CUDA), and puts each `Box` back around its copy."""

    _synchronize_after_execute = False

    def __init__(self, pin: bool):
        self.pin = pin
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=pin))

    def stage(self, state_dict: dict) -> Future:
        boxes = {key: t for key, t in state_dict.items() if isinstance(t, Box)}
        if self.pin:  # DefaultStager's stream does not wait for the compute stream: the last step must be done
            torch.accelerator.synchronize()
        copied = self.stager.stage({key: t.local if key in boxes else t for key, t in state_dict.items()})
        staged: Future = Future()

        def rewrap(done: Future) -> None:
            try:
                staged.set_result({key: Box(t, boxes[key].shape, boxes[key].offsets) if key in boxes else t
                                   for key, t in done.result().items()})
            except BaseException as err:  # noqa: BLE001 - the staging's failure is the save's
                staged.set_exception(err)
        copied.add_done_callback(rewrap)
        return staged

    def close(self) -> None:
        self.stager.close()


def load_state(tensors: dict[str, torch.Tensor], folder: Path, world: AxisGroup) -> None:
    """Fill `tensors` in place from `folder`, resharding by global shapes (every rank calls)."""
    with _as_error("read"):
        dcp.load(tensors, storage_reader=SafeReader(folder), process_group=world.group, no_dist=world.size == 1)


def iter_full(folder: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key, full tensor) of every tensor entry of a checkpoint whose key starts with `prefix`, one at a time,
    in one process: each is allocated and read by its own dcp.load of that one key, when the caller asks for
    it, so the peak is one tensor beyond what the caller keeps (the forecast command keeps none)."""
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    for key, meta in metadata.items():
        if isinstance(meta, TensorStorageMetadata) and key.startswith(prefix):
            tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            with _as_error("read"):
                dcp.load({key: tensor}, storage_reader=SafeReader(folder), no_dist=True)
            yield key, tensor
            del tensor  # not alive here when the next is allocated


def read_full(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor entry of a checkpoint (whose key starts with `prefix`) as full tensors, in one process
    (export, inspection, tests): `iter_full` kept in a dict."""
    return dict(iter_full(folder, prefix))


@torch.no_grad()
def fill_from_full(view: View, full: dict[str, torch.Tensor]) -> None:
    """Fill this rank's `view` from the full single-process tensors `full` (same keys), every rank cutting its
    own box (no communication); a whole tensor is copied whole."""
    for key, tensor in view.tensors.items():
        if isinstance(tensor, Box):
            tensor.local.copy_(full[key][tensor.slices()])
        else:
            tensor.copy_(full[key])


def write_full(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Write full tensors as a one-process DCP checkpoint (import)."""
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=True)


@contextlib.contextmanager
def _as_error(what: str):
    """DCP's CheckpointException (every rank's failures, raised on every rank) derives from BaseException:
    re-raise it as an ordinary error, so that the callers' handlers see it, with the failures it gathered
    (`CheckpointIOError.causes`: whether they are I/O or collective errors decides what a reader does)."""
    try:
        yield
    except CheckpointException as err:
        failures = "; ".join(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
                             for rank, (e, _) in sorted(err.failures.items()))
        raise CheckpointIOError(f"could not {what} the checkpoint ({failures})",
                                [e for _, (e, _) in sorted(err.failures.items())]) from None
