"""Fingerprints of the first training steps (`trainer.fingerprint_steps`), read by
`python -m utils.compare --diverge RUN_A RUN_B` to name where two runs part (docs/tools.md).

For each of the first N steps, every rank takes float64 statistics [sum, sum of squares, sum of |x|] of
each parameter piece it holds (distributed/placement.py `local_pieces`: a tp shard, an FSDP shard, a
pipeline rank's stages), twice: the gradient as the optimizer will see it (reduced over every axis and
unscaled, before clipping) and the update (the weights after the step minus before), with two more for the
update: [sum of u*g, sum of |u*g|] over its elements u and their gradients g (as clipped; Adam divides each
element by its own gradient's size, so an element whose gradient is zero in exact arithmetic, an attention
key bias, moves by rounding noise of either sign, which u*g weighs at nothing). Rank 0 gathers the
pieces, counts each box of a full tensor once (dp and cp replicas, tp ranks' copies of a replicated norm
hold the same box) and sums the boxes of each parameter: the statistics of the full tensor, the same under
every layout up to rounding. The last pipeline stage's copy of a tied embedding is left out (the first
stage's counts, as in the gradient norm). `fingerprints.json` in run.dir then holds
  {"precision": ..., "layout": ..., "order": [names in the single-process definition order],
   "steps": {"<step>": {"grad": {name: [sum, sumsq, abssum]}, "update": {name: [sum, sumsq, abssum, dot, absdot]}}}}
and grows by one step per fingerprinted step (a run that crashes keeps the steps it took). Off at 0: the
step then pays nothing. During a fingerprinted step each rank keeps a copy of its weights (the update is
a difference), and the gather moves a few numbers per parameter, outside comm/<axis>_bytes (a
diagnostic, not the step's traffic).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from distributed.collectives import gather_objects
from distributed.placement import Piece, local_pieces

FILE = "fingerprints.json"
PASSES = ("grad", "update")  # in the order a step computes them

Entry = tuple  # (name, offsets, local shape, (stage, index): where it is defined, {pass: [sum, sumsq, abssum]})


@contextmanager
def fingerprinted(trainer, step: int) -> Iterator[None]:
    """Around the clipping and update of `step` (counted from 1) in `Trainer.finish_step`: the gradients on
    entry, the update on exit; nothing beyond `trainer.fingerprint_steps`. An exception inside leaves
    the step unrecorded (no rank gathers)."""
    if step > trainer.tc.fingerprint_steps:
        yield
        return
    pieces, where = recorded_pieces(trainer.raw_model, trainer.pipeline)
    grads = statistics([gradient(p) for p in pieces])
    before = [p.local.detach().clone() for p in pieces]
    yield
    updates = statistics([p.local.detach() - b for p, b in zip(pieces, before, strict=True)],
                         [gradient(p) for p in pieces])  # as clipped: what the optimizer used
    mine = [(p.name, p.offsets, tuple(p.local.shape), where[i], {"grad": g, "update": u})
            for i, (p, g, u) in enumerate(zip(pieces, grads, updates, strict=True))]
    world = trainer.grid.world
    entries = [mine] if world.size == 1 else gather_objects(mine, world.group)
    if trainer.grid.is_main:
        write_step(Path(trainer.run_dir) / FILE, step, entries, trainer.cfg.precision.mode, trainer.grid.signature)


def recorded_pieces(model: torch.nn.Module, pipeline) -> tuple[list[Piece], list[tuple[int, int]]]:
    """This rank's pieces but a pipeline's duplicate of a tied embedding, and where each is defined:
    (its first pipeline stage, its position among this rank's parameters). A stage is on one pp rank,
    and a cut model keeps the full model's order, so sorting by it gives the single-process order."""
    skip = pipeline.duplicates if pipeline is not None else set()
    stage_of: dict[int, int] = {}
    for stage in pipeline.stages if pipeline is not None else ():
        for param in stage.submod.parameters():
            stage_of[id(param)] = min(stage_of.get(id(param), stage.submod.index), stage.submod.index)
    pieces = [p for p in local_pieces(model) if id(p.param) not in skip]
    return pieces, [(stage_of.get(id(p.param), 0), i) for i, p in enumerate(pieces)]


def gradient(piece: Piece) -> torch.Tensor:
    """The local values of a piece's gradient (zeros where it has none)."""
    grad = piece.param.grad
    if grad is None:
        return torch.zeros_like(piece.local)
    return grad.to_local() if isinstance(grad, DTensor) else grad


def statistics(tensors: list[torch.Tensor], grads: list[torch.Tensor] | None = None) -> list[list[float]]:
    """[sum, sum of squares, sum of |x|] of each tensor in float64, read from the device once; with `grads`
    (of an update) also [sum of x*g, sum of |x*g|]."""
    rows = []
    for i, t in enumerate(tensors):
        x = t.detach().to(torch.float64)
        row = [x.sum(), (x * x).sum(), x.abs().sum()]
        if grads is not None:
            xg = x * grads[i].detach().to(torch.float64)
            row += [xg.sum(), xg.abs().sum()]
        rows.append(torch.stack(row))
    return torch.stack(rows).cpu().tolist() if rows else []


def merge(entries: list[list[Entry]]) -> tuple[dict[str, dict[str, list[float]]], list[str]]:
    """Every rank's entries -> ({pass: {name: statistics of the full tensor}}, names in definition order).
    A box (name, offsets, local shape) held by several ranks counts once; a parameter's boxes add up."""
    seen, totals, where = set(), {p: {} for p in PASSES}, {}
    for rank_entries in entries:
        for name, offsets, shape, defined, stats in rank_entries:
            where[name] = min(where.get(name, tuple(defined)), tuple(defined))
            if (name, tuple(offsets), tuple(shape)) in seen:
                continue
            seen.add((name, tuple(offsets), tuple(shape)))
            for kind in PASSES:
                total = totals[kind].setdefault(name, [0.0] * len(stats[kind]))
                totals[kind][name] = [a + b for a, b in zip(total, stats[kind], strict=True)]
    return totals, sorted(where, key=where.__getitem__)


def write_step(path: Path, step: int, entries: list[list[Entry]], precision: str, layout: str) -> None:
    """Add `step` to `path` (a new file at step 1, or when none exists), atomically."""
    totals, order = merge(entries)
    record = {"precision": precision, "layout": layout, "order": order, "steps": {}}
    if step > 1 and path.is_file():
        record["steps"] = json.loads(path.read_text())["steps"]
    record["steps"][str(step)] = totals
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
