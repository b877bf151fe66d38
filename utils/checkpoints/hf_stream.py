"""Hugging Face weights a bounded part at a time: import by slices of the files, export by shards.

Import (`read_pieces`, for `trainer.init_from=<folder>`): each rank fills the pieces it holds
(distributed/placement.py: the box `full[offsets[d] : offsets[d] + local.shape[d]]` of each single-process
tensor) by reading only the rows and columns in them from the safetensors files (`safe_open(...).get_slice`),
by the rules the family's adapter gives (networks/exchange.py: a `Rule` per tensor, `row_runs` maps a row range
onto reads of contiguous source rows), the same rules the whole-tensor import and the export read.
Peak memory: the largest single read, at most one piece's box; never a whole file or model. The config
(`hf.check_folder`) and every file's tensor names and shapes (headers only) are checked first, as the
whole-tensor import (`hf.import_state`) checks them.

Export (`write_weights`): safetensors' `save_file` takes the whole dict of a file, so a folder is written as
shards of at most `SHARD_BYTES` (model.safetensors.index.json lists them, as transformers writes them), each
produced when written: peak memory is one shard (plus the tensor being converted), with a `WeightStream`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from distributed.placement import Piece
from networks.exchange import HFAdapter, fill
from utils import require
from utils.checkpoints import hf


# ----------------------------------------------------------------------------------------------- import
def open_sources(folder: Path, adapter: HFAdapter, stack: contextlib.ExitStack) -> dict[str, tuple[object, str]]:
    """Their name (as the adapter's rules name it: `HFAdapter.stored`, buffers left out) -> (open file, name in it)
    of every tensor of the folder's safetensors files (memory-mapped: nothing is read yet)."""
    from safetensors import safe_open

    index = {}
    for file in hf.weight_files(folder):
        try:
            handle = stack.enter_context(safe_open(file, "pt"))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise hf.unreadable(file, err) from None
        for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            if (ours := adapter.stored(name)) is not None:
                index[ours] = (handle, name)
    return index


def check_sources(index: dict[str, tuple[object, str]], wanted: dict[str, tuple[int, ...]], model) -> None:
    """Every tensor present with the shape config.json implies, none left over (a tied head saved anyway aside)."""
    for name, shape in wanted.items():
        require(name in index, f"the weights lack {name}", "DIR", "give the complete model folder")
        handle, stored = index[name]
        have = tuple(handle.get_slice(stored).get_shape())
        require(have == shape, f"{name} has shape {have}, config.json implies {shape}", "DIR",
                "give weights that match their config.json")
    extra = sorted(set(index) - set(wanted) - hf.adapter(model).tolerated(model))
    require(not extra, f"the weights hold {len(extra)} tensors a {model.arch} model of config.json has not "
            f"(e.g. {extra[:1]})", "DIR", "check that config.json's depth and options describe these weights")


def read_pieces(folder: Path, model, vocab_size: int | None, pieces: Iterable[Piece]) -> None:
    """Fill each of this rank's `pieces` (local_pieces of a model of config `model`) from the Hugging Face
    folder, reading only their rows and columns; the folder is checked first (`hf.check_folder`: the config
    and the tokenizer's `vocab_size`; then the files' names and shapes)."""
    vocab = hf.check_folder(folder, model, vocab_size)["vocab_size"]
    rules, wanted, _ = hf.import_rules(model, vocab)
    with contextlib.ExitStack() as stack:
        index = open_sources(folder, hf.adapter(model), stack)
        check_sources(index, wanted, model)
        for piece in pieces:
            assert piece.name in rules, f"{piece.name} has no Hugging Face source"
            fill(piece.local, piece.slices(), rules[piece.name], lambda name: index[name][0].get_slice(index[name][1]))


# ----------------------------------------------------------------------------------------------- export
@dataclass(frozen=True)
class WeightStream:
    """Weights produced a group at a time: `produce(key)` gives the tensors of `key`, `sizes[key]` their bytes."""

    sizes: dict[str, int]
    produce: Callable[[str], dict[str, torch.Tensor]]


SHARD_BYTES = 2 * 2**30  # the largest safetensors file written (a larger single group gets a file of its own)


def shard_keys(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """The keys in order, cut into groups of at most `shard_bytes` (a larger key alone)."""
    shards, size = [[]], 0
    for key, n in sizes.items():
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


def write_safetensors(path: Path, keys: list[str], produce: Callable[[str], dict[str, torch.Tensor]],
                      metadata: dict[str, str]) -> list[str]:
    """One safetensors file of the tensors `produce(key)` gives for each key, written as they come: their bytes
    go to a spool file beside `path` while the header is gathered, then the header and the spooled bytes
    (copied in blocks) make the file. Peak memory: one key's tensors. Returns the tensor names."""
    header, offset = {}, 0
    spool = path.with_name(path.name + ".data")
    with open(spool, "wb") as data:
        for key in keys:
            for name, tensor in produce(key).items():
                tensor = tensor.detach().contiguous().cpu()
                raw = tensor.reshape(-1).view(torch.uint8).numpy()  # little-endian bytes, row-major
                data.write(memoryview(raw))
                header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + raw.nbytes]}
                offset += raw.nbytes
                del tensor, raw
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    try:
        with open(path, "wb") as out, open(spool, "rb") as data:
            out.write(len(text).to_bytes(8, "little") + text)
            shutil.copyfileobj(data, out, 16 * 2**20)
    finally:
        spool.unlink(missing_ok=True)
    return list(header)


def write_weights(folder: Path, weights: WeightStream, shard_bytes: int = SHARD_BYTES) -> int:
    """Write the weights as model.safetensors or, past `shard_bytes`, as shards listed by
    model.safetensors.index.json; returns the number of files. Peak memory: one group's tensors (a group is
    produced, written and freed before the next: `write_safetensors`)."""
    shards = shard_keys(weights.sizes, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an earlier export's files would be read beside these
    weight_map = {}
    for name, keys in zip(names, shards, strict=True):
        written = write_safetensors(folder / name, keys, weights.produce, {"format": "pt"})
        weight_map.update(dict.fromkeys(written, name))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(weights.sizes.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(names)


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | WeightStream,
                 beside: Iterable[Path] | None = (), shard_bytes: int | None = None) -> None:
    """config.json, the weights (all given, or a stream produced a shard at a time: hf_stream.write_weights; one
    file, or shards past `shard_bytes`) and copies of the files `beside` (a tokenizer.json, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if isinstance(tensors, dict):
        tensors = WeightStream({k: t.numel() * t.element_size() for k, t in tensors.items()},
                               lambda key, held=tensors: {key: held[key]})
    write_weights(folder, tensors, shard_bytes or SHARD_BYTES)
    for file in beside or ():
        shutil.copyfile(file, folder / file.name)
