"""Hugging Face weights a bounded part at a time: import by slices of the files, export by shards.

Import (`read_pieces`, for `trainer.init_from=<folder>`): each rank fills the pieces it holds
(distributed/placement.py: the box `full[offsets[d] : offsets[d] + local.shape[d]]` of each single-process
tensor) by reading only the rows and columns in them from the safetensors files (`safe_open(...).get_slice`),
with the conversions of utils/checkpoints/hf.py in slice form. A `Rule` says where the rows of one of our
tensors come from, and `row_runs` maps a row range onto reads of contiguous source rows:
- "same": row r is source row r (GPT-2's Conv1D: column r of the (in, out) tensor, read as the transposed box);
  rows past the source's (the padded vocabulary) are zero;
- "qkv": rows (kv group, [the group's q heads, k, v], head_dim) come from q, k and v (Llama's three tensors,
  or GPT-2's c_attn, whose ({q, k, v}, head, hd) parts start at 0, E and 2E): per group, one read of each;
- "gate_up": row 2u + s is row u of gate (s = 0) or up (s = 1): one read of each, written with a stride of 2.
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
from utils import require
from utils.checkpoints import hf

Run = tuple[int, int, int, int | None, int]  # (first row in the piece, step, count, source or None: zeros, source row)


# ----------------------------------------------------------------------------------------------- import
@dataclass(frozen=True)
class Rule:
    """Where the rows of one of our tensors come from (see the module doc for `kind`)."""

    kind: str  # "same" | "qkv" | "gate_up"
    sources: tuple[str, ...]  # their tensors (GPT-2's without "transformer."): one, (q, k, v) or (gate, up)
    starts: tuple[int, ...]  # the row of each source (in our orientation) where its part begins
    transposed: bool  # stored (in, out): our rows are its columns (GPT-2's Conv1D)
    real_rows: int = 0  # "same": rows from here on are zero padding (the vocabulary)
    group: tuple[int, int] = (0, 0)  # "qkv": (q rows, k rows) of one kv group


def import_rules(model, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, Rule], dict[str, tuple[int, ...]]]:
    """(our name -> its Rule, their name -> the shape config.json implies, as stored) for the model config
    `model` whose single-process shapes (vocabulary unpadded: `hf.expected_shapes`) are `shapes`."""
    head_dim, groups = model.embed_dim // model.num_heads, model.kv_heads
    q_rows = model.num_heads // groups * head_dim
    rules, wanted = {}, {}
    for key, shape in shapes.items():
        tied = key == "lm_head.weight" and model.tie_embeddings
        names = hf.their_names(model.arch, "tok_embed.weight" if tied else key)
        transposed = hf.is_conv1d(model.arch, names[0])
        if ".attn.qkv." in key:
            kv, total = groups * head_dim, shape[0]
            starts = (0, total - 2 * kv, total - kv) if len(names) == 1 else (0, 0, 0)
            parts = [shape] if len(names) == 1 else [(total - 2 * kv, *shape[1:]), (kv, *shape[1:]), (kv, *shape[1:])]
            rules[key] = Rule("qkv", names * (3 // len(names)), starts, transposed, group=(q_rows, head_dim))
        elif len(names) == 2:
            parts = [(shape[0] // 2, *shape[1:])] * 2
            rules[key] = Rule("gate_up", names, (0, 0), transposed)
        else:
            parts = [shape]
            rules[key] = Rule("same", names, (0,), transposed, real_rows=shape[0])
        wanted.update({n: tuple(reversed(s)) if transposed else s for n, s in zip(names, parts, strict=True)})
    return rules, wanted


def row_runs(rule: Rule, r0: int, r1: int) -> list[Run]:
    """The reads that fill our rows [r0, r1): each a run of contiguous source rows, written to the piece's rows
    first, first + step, ... (`Run`)."""
    runs: list[Run] = []
    if rule.kind == "same":
        real = max(r0, min(r1, rule.real_rows))  # plant: slice_import_last_row_as_padding
        runs += [(0, 1, real - r0, 0, r0)] if real > r0 else []
        runs += [(real - r0, 1, r1 - real, None, 0)] if r1 > real else []
    elif rule.kind == "gate_up":
        for s in (0, 1):  # our row 2u + s <- row u of source s
            u0, u1 = max(0, -(-(r0 - s) // 2)), -(-(r1 - s) // 2)
            runs += [(2 * u0 + s - r0, 2, u1 - u0, s, u0)] if u1 > u0 else []
    else:
        q, kv = rule.group
        size = q + 2 * kv
        for g in range(r0 // size, -(-r1 // size)):
            for src, (first, n, row) in enumerate(((g * size, q, g * q), (g * size + q, kv, g * kv),
                                                   (g * size + q + kv, kv, g * kv))):
                lo, hi = max(first, r0), min(first + n, r1)
                runs += [(lo - r0, 1, hi - lo, src, rule.starts[src] + row + lo - first)] if hi > lo else []
    return runs


@torch.no_grad()
def fill_piece(piece: Piece, rule: Rule, open_slice: Callable[[str], object]) -> None:
    """Fill `piece.local` by reads of its rows and columns only (one slice at a time)."""
    local = piece.local
    if local.numel() == 0:
        return
    rows, *cols = piece.slices()
    for first, step, count, src, src_row in row_runs(rule, rows.start, rows.stop):
        dest = local[first:first + step * (count - 1) + 1:step]
        if src is None:
            dest.zero_()
            continue
        part, read = open_slice(rule.sources[src]), slice(src_row, src_row + count)
        dest.copy_(part[cols[0], read].t() if rule.transposed else part[(read, *cols)])


def open_sources(folder: Path, arch: str, stack: contextlib.ExitStack) -> dict[str, tuple[object, str]]:
    """Their name (GPT-2's without "transformer.", buffers left out) -> (open file, name in it) of every tensor
    of the folder's safetensors files (memory-mapped: nothing is read yet)."""
    from safetensors import safe_open

    ignored = hf.GPT2_IGNORED if arch == "gpt" else hf.LLAMA_IGNORED
    index = {}
    for file in hf.weight_files(folder):
        try:
            handle = stack.enter_context(safe_open(file, "pt"))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise hf.unreadable(file, err) from None
        for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            if not name.endswith(ignored):
                index[name.removeprefix("transformer.") if arch == "gpt" else name] = (handle, name)
    return index


def check_sources(index: dict[str, tuple[object, str]], wanted: dict[str, tuple[int, ...]], model) -> None:
    """Every tensor present with the shape config.json implies, none left over (a tied head saved anyway aside)."""
    for name, shape in wanted.items():
        require(name in index, f"the weights lack {name}", "DIR", "give the complete model folder")
        handle, stored = index[name]
        have = tuple(handle.get_slice(stored).get_shape())
        require(have == shape, f"{name} has shape {have}, config.json implies {shape}", "DIR",
                "give weights that match their config.json")
    extra = sorted(set(index) - set(wanted) - ({"lm_head.weight"} if model.tie_embeddings else set()))
    require(not extra, f"the weights hold {len(extra)} tensors a {model.arch} model of config.json has not "
            f"(e.g. {extra[:1]})", "DIR", "check that config.json's depth and options describe these weights")


def read_pieces(folder: Path, model, vocab_size: int | None, pieces: Iterable[Piece]) -> None:
    """Fill each of this rank's `pieces` (local_pieces of a model of config `model`) from the Hugging Face
    folder, reading only their rows and columns; the folder is checked first (`hf.check_folder`: the config
    and the tokenizer's `vocab_size`; then the files' names and shapes)."""
    vocab = hf.check_folder(folder, model, vocab_size)["vocab_size"]
    rules, wanted = import_rules(model, hf.expected_shapes(model, vocab))
    with contextlib.ExitStack() as stack:
        index = open_sources(folder, model.arch, stack)
        check_sources(index, wanted, model)
        for piece in pieces:
            assert piece.name in rules, f"{piece.name} has no Hugging Face source"
            fill_piece(piece, rules[piece.name], lambda name: index[name][0].get_slice(index[name][1]))


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


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | WeightStream, tokenizer: Path | None,
                 shard_bytes: int | None = None) -> None:
    """config.json, the weights (all given, or a stream produced a shard at a time: hf_stream.write_weights; one
    file, or shards past `shard_bytes`) and (from `tokenizer`, a folder or a tokenizer.json) the tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if isinstance(tensors, dict):
        tensors = WeightStream({k: t.numel() * t.element_size() for k, t in tensors.items()},
                               lambda key, held=tensors: {key: held[key]})
    write_weights(folder, tensors, shard_bytes or SHARD_BYTES)
    if tokenizer is not None:
        source = tokenizer if tokenizer.is_dir() else tokenizer.parent
        names = hf.TOKENIZER_FILES if tokenizer.is_dir() else (tokenizer.name,)
        for name in names:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
