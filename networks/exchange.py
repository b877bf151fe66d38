"""Weights exchanged with Hugging Face's layout: what a family's adapter declares, and the one table both
directions read.

A family that trades weights with Hugging Face gives its `networks.spec.ModelSpec` an `hf` adapter (`HFAdapter`,
in the family's folder). The adapter reads and writes config.json (`settings`, `config`) and says, for each of
our single-process tensors, which of their tensors it is made of (`rules`: a `Rule` each). Everything else is
the framework's and the same for every family (utils/checkpoints/hf.py, hf_stream.py): folders, safetensors,
the checks, the vocabulary padding, import of whole tensors (`assemble`), import by slices per rank
(`row_runs` over each rank's boxes) and export (`disassemble`, the same runs backwards). So a family states its
mapping once, and import, sliced import and streamed export cannot disagree.

A `Rule` says where the rows of one of our tensors come from (`kind`):
- "same": row r is source row r (a (in, out) source, `transposed`, read as its columns); rows from `real_rows`
  on are zero padding (the vocabulary);
- "qkv": rows (kv group, [the group's query heads, k, v], head_dim) come from q, k and v (three tensors, or one
  fused tensor whose parts start at `starts`): per group, one read of each;
- "gate_up": row 2u + s is row u of gate (s = 0) or up (s = 1).
A run (`row_runs`) is (first row, step, count, source or None for zeros, source row): the rows
first, first + step, ..., of ours are `count` contiguous rows of the source from its row `source row`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

Run = tuple[int, int, int, int | None, int]  # (first row in ours, step, count, source or None: zeros, source row)


@dataclass(frozen=True)
class Rule:
    """Where the rows of one of our tensors come from (see the module doc for `kind`)."""

    kind: str  # "same" | "qkv" | "gate_up"
    sources: tuple[str, ...]  # their tensors (as `HFAdapter.stored` names them): one, (q, k, v) or (gate, up)
    starts: tuple[int, ...]  # the row of each source (in our orientation) where its part begins
    transposed: bool  # stored (in, out): our rows are its columns (GPT-2's Conv1D)
    real_rows: int = 0  # "same": rows from here on are zero padding (the vocabulary)
    group: tuple[int, int] = (0, 0)  # "qkv": (q rows, k rows) of one kv group


class HFAdapter(Protocol):
    """A family's exchange with Hugging Face (in its folder; `ModelSpec.hf`)."""

    model_types: tuple[str, ...]  # the config.json `model_type`s it reads (the first is the one it writes)
    vocab_rows: tuple[str, ...]  # our tensors whose rows are the vocabulary (padded here, not there)

    def settings(self, config: Mapping[str, Any]) -> dict[str, object]:
        """The model.* settings of a config.json (a ConfigError on "DIR" for one it cannot read)."""

    def differences(self, model: Any, settings: Mapping[str, object]) -> list[str]:
        """`model.key=value` overrides that make the model config `model` the one `settings` describe."""

    def config(self, model: Any, vocab_size: int, tokens: Mapping[str, int | None]) -> dict:
        """config.json of the model config `model` (a ConfigError on "model" for options they have not);
        `tokens`: bos_token_id, eos_token_id and pad_token_id."""

    def build(self, model: Any, vocab_size: int) -> nn.Module:
        """Our single-process model (called under torch.device("meta"): its state's names and shapes)."""

    def rules(self, model: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Rule]:
        """A Rule for each of our tensors of single-process shapes `shapes` (vocabulary unpadded)."""

    def tied(self, model: Any) -> dict[str, str]:
        """Our tensors that are another of ours (a tied head: its embedding), written once."""

    def tolerated(self, model: Any) -> set[str]:
        """Their tensors a folder may hold that are not read (a tied head saved anyway)."""

    def stored(self, name: str) -> str | None:
        """Their tensor `name` as the rules name it (a prefix dropped); None for a buffer to leave out."""

    def storage(self, name: str) -> str:
        """The inverse of `stored`: the name a rule's source is written under."""


def row_runs(rule: Rule, r0: int, r1: int) -> list[Run]:
    """The reads that fill our rows [r0, r1): each a run of contiguous source rows, written to the rows
    first, first + step, ... (`Run`, relative to r0)."""
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
def fill(local: torch.Tensor, box: tuple[slice, ...], rule: Rule, open_slice: Callable[[str], Any]) -> None:
    """Fill `local`, the box `box` (row slice first) of one of our tensors, by reads of its rows and columns only:
    `open_slice(source)` gives a source indexable by (rows, columns) as stored (a tensor, a safetensors slice)."""
    if local.numel() == 0:
        return
    rows, *cols = box
    for first, step, count, src, src_row in row_runs(rule, rows.start, rows.stop):
        dest = local[first:first + step * (count - 1) + 1:step]
        if src is None:
            dest.zero_()
            continue
        part, read = open_slice(rule.sources[src]), slice(src_row, src_row + count)
        dest.copy_(part[cols[0], read].t() if rule.transposed else part[(read, *cols)])


def assemble(rule: Rule, shape: tuple[int, ...], sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Our whole fp32 tensor of `shape` (rows past the sources': zero padding) from their whole tensors."""
    out = torch.empty(shape)
    fill(out, tuple(slice(0, n) for n in shape), rule, lambda name: sources[name].float())
    return out


def disassemble(rule: Rule, ours: torch.Tensor, stored_shapes: Mapping[str, tuple[int, ...]]
                ) -> dict[str, torch.Tensor]:
    """Their fresh, contiguous fp32 tensors made of our tensor `ours` (padding rows dropped), the inverse of
    `assemble`; `stored_shapes`: each source's shape as stored. A meta `ours` gives meta tensors (their shapes)."""
    t = ours.detach().float()
    theirs = {name: t.new_zeros(tuple(reversed(stored_shapes[name])) if rule.transposed else stored_shapes[name])
              for name in dict.fromkeys(rule.sources)}
    for first, step, count, src, src_row in row_runs(rule, 0, t.shape[0]):
        if src is not None:
            theirs[rule.sources[src]][src_row:src_row + count] = t[first:first + step * (count - 1) + 1:step]
    return {name: (p.t() if rule.transposed else p).contiguous() for name, p in theirs.items()}


def stored_shapes(rules: Mapping[str, Rule], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Their tensors' shapes as stored, implied by the rules of ours of `shapes` (vocabulary unpadded)."""
    wanted: dict[str, tuple[int, ...]] = {}
    for key, rule in rules.items():
        shape = shapes[key]
        if rule.kind == "qkv" and len(set(rule.sources)) == 3:  # q, k and v apart (one fused source: ours)
            q_rows, k_rows = rule.group
            groups = shape[0] // (q_rows + 2 * k_rows)
            parts = [(groups * q_rows, *shape[1:])] + [(groups * k_rows, *shape[1:])] * 2
        elif rule.kind == "gate_up":
            parts = [(shape[0] // 2, *shape[1:])] * 2
        else:
            parts = [shape] * len(rule.sources)
        for name, part in zip(rule.sources, parts, strict=True):
            wanted[name] = tuple(reversed(part)) if rule.transposed else part
    return wanted
