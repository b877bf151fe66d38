"""The checkpoint view of a parallel model: every tensor under its single-process name with its global
shape, written and read with torch.distributed.checkpoint (DCP), which reshards by that metadata.

`checkpoint_view(model, optimizer, grid)` maps flat keys to tensors that share storage with the live ones:

    model/<name>              every state-dict entry (parameters and persistent buffers)
    optim/<name>/<state>      Adam's moments and step count of every parameter, under each of its names

Names are the single-process model's (pipeline stages keep global block names; a tied embedding is found
under both of its names, so a pipeline's two copies and the serial model's one parameter read the same
entries). A parameter split evenly over a tensor-parallel axis is a DTensor view on that axis's mesh
(`Shard(dim)`: DCP records its global shape and this rank's offset, and loading into another layout
reads the overlapping pieces); a replicated one is a plain tensor (DCP keeps one copy of equal keys). An
uneven split (e.g. a 1408-row vocabulary over tp=3) has no DTensor form (DTensor places chunks as
torch.chunk does): its full tensor is gathered over the axis (counted) and saved as replicated, and on
load read whole and sliced (`View.finish_load`). Moments of a parameter follow its layout.

`save_state`/`load_state` run DCP over the whole job (`no_dist` in one process) or, for background
saves, on a dedicated group. Checkpoint metadata is read with an unpickler that admits only DCP's own
classes: opening a checkpoint never runs code it carries.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distributed.collectives import all_gather, split_sizes
from distributed.placement import parameter_names, shard_layout
from utils.comm import AxisGroup, Grid

# DCP warns that it assumes one process when torch.distributed is not initialized: here that is meant
# (also in the thread of a background save, hence a process-wide filter).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class View:
    """Flat key -> tensor (sharing storage with the model and optimizer), and what loading must finish."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # after DCP filled `tensors`: (buffer read into, live tensor, how to slice the buffer for this rank)
    copies: list[tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)

    @torch.no_grad()
    def finish_load(self) -> None:
        """Copy this rank's part of each tensor that was read whole (uneven tp splits, FSDP shards under tp)."""
        for buffer, live, part in reversed(self.copies):  # an FSDP shard's tp shard is filled before it
            live.copy_(part(buffer))

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(t.shape) for key, t in self.tensors.items()}


def _split_part(axis: AxisGroup, dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's part along `dim` under the tensor_split convention of the tp layers."""
    def part(full: torch.Tensor) -> torch.Tensor:
        sizes = split_sizes(full.shape[dim], axis.size)
        return full.narrow(dim, sum(sizes[:axis.rank]), sizes[axis.rank])
    return part


def _fsdp_part(axis: AxisGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's FSDP2 shard: torch.chunk along dim 0 (empty past the last chunk)."""
    def part(full: torch.Tensor) -> torch.Tensor:
        chunks = full.chunk(axis.size)
        return chunks[axis.rank] if axis.rank < len(chunks) else full[:0]
    return part


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
    """The flat view of this rank's model (and optimizer) state; see the module doc. `for_load`: uneven
    tensors get empty full-size buffers to read into, instead of being gathered."""
    for module in model.modules():  # after a no-grad forward without resharding, FSDP modules hold the
        if isinstance(module, FSDPModule):  # gathered parameters: back to the sharded ones the optimizer has
            module.reshard()
    layout, view = shard_layout(model), View()

    def add(key: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
        tensor = tensor.detach()
        if id(param) not in layout or tensor.shape != param.shape:
            view.tensors[key] = tensor  # replicated, a scalar, or an FSDP DTensor DCP reshards itself
            return
        if isinstance(tensor, DTensor):  # FSDP shard of a tp shard: through this rank's whole tp shard
            fsdp = grid.replicas
            if for_load:
                whole = tensor.to_local().new_empty(tensor.shape)
                view.copies.append((whole, tensor.to_local(), _fsdp_part(fsdp)))
            else:
                sizes = [len(c) for c in torch.empty(tensor.shape[0], 0).chunk(fsdp.size)]
                sizes += [0] * (fsdp.size - len(sizes))
                whole = all_gather(tensor.to_local().contiguous(), fsdp, 0, sizes)
            tensor = whole
        axis, dim, full = layout[id(param)]
        shape = list(tensor.shape)
        shape[dim] = full
        if full % axis.size == 0:
            view.tensors[key] = DTensor.from_local(tensor, grid.mesh[axis.name], [Shard(dim)], run_check=False,
                                                   shape=torch.Size(shape), stride=_contiguous_stride(shape))
        elif for_load:
            view.tensors[key] = tensor.new_empty(shape)
            view.copies.append((view.tensors[key], tensor, _split_part(axis, dim)))
        else:
            view.tensors[key] = all_gather(tensor.contiguous(), axis, dim, split_sizes(full, axis.size))

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


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


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


def truncated_files(folder: Path) -> list[str]:
    """'name (have of needed bytes)' for each data file shorter than the metadata says (or missing)."""
    needed: dict[str, int] = {}
    for info in SafeReader(folder).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = {name: (Path(folder) / name).stat().st_size if (Path(folder) / name).is_file() else 0 for name in needed}
    return [f"{name} ({sizes[name]} of {n} bytes)" for name, n in sorted(needed.items()) if sizes[name] < n]


def save_state(tensors: dict[str, torch.Tensor], folder: Path, world: AxisGroup, *,
               background: bool = False, background_group=None) -> Future | None:
    """Write `tensors` of every rank into `folder` (every rank calls). `background`: the tensors are
    copied to host memory first and written by a thread, coordinating on `background_group` (a gloo
    group of all ranks, never the one the training loop uses); returns the Future that completes once
    every rank's files and the metadata are written."""
    writer = dcp.FileSystemWriter(folder, sync_files=True)
    if background:
        return dcp.async_save(tensors, storage_writer=writer, process_group=background_group,
                              no_dist=world.size == 1)
    with _as_error("write"):
        dcp.save(tensors, storage_writer=writer, process_group=world.group, no_dist=world.size == 1)
    return None


def load_state(tensors: dict[str, torch.Tensor], folder: Path, world: AxisGroup) -> None:
    """Fill `tensors` in place from `folder`, resharding by global shapes (every rank calls)."""
    with _as_error("read"):
        dcp.load(tensors, storage_reader=SafeReader(folder), process_group=world.group, no_dist=world.size == 1)


def read_full(folder: Path) -> dict[str, torch.Tensor]:
    """Every entry of a checkpoint as full tensors, in one process (export, inspection, tests)."""
    shapes = read_shapes(folder)
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(shape, dtype=metadata[key].properties.dtype)
               for key, shape in shapes.items() if shape is not None}
    dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=True)
    return tensors


@torch.no_grad()
def fill_from_full(view: View, full: dict[str, torch.Tensor]) -> None:
    """Fill this rank's `view` from the full single-process tensors `full` (same keys), every rank cutting its
    own part: a DTensor's local shard by its placements (no communication), a replicated tensor whole."""
    for key, tensor in view.tensors.items():
        source = full[key].to(tensor.device, tensor.dtype)
        if isinstance(tensor, DTensor):
            part = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(part.to_local())
        else:
            tensor.copy_(source)
    view.finish_load()


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
