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

Activations (`recording`, around the forward and backward of the same steps; not under `precision.compile`,
whose graphs would trace the hooks): the outputs of the model's parts (its top-level modules with parameters,
each block, each block's norms, attention, MLP and attention core, module names as in the single-process model;
those computed per sample: a learned position embedding's lookup, the same for every micro-batch, is not)
and the gradient arriving at each output (the input gradient of what follows it), [sum, sum of squares, sum of
|x|] in float64 summed over the step's micro-batches, recomputations under activation checkpointing left out.
Each of those outputs is whole in every layout (a row-parallel layer reduces inside its module): a rank holds a
part of it (a tp shard of features or heads, a cp or sp shard of tokens, a dp shard of the batch) or a copy (tp
without sp); rank 0 adds the parts and counts identical copies once: the statistics of the single-process
tensor. The file then also holds "modules": [names in definition order] and, per step, "forward" and "out_grad":
{module: [sum, sumsq, abssum]}. The output gradients carry the loss normalisation of the layout (a dp rank's
loss is its own batch's mean), one factor for the whole step, which `python -m utils.compare --diverge`
divides out. Copies of a parameter's box on several ranks must agree bitwise; a step where some do not also
holds "replicas": {pass: {parameter: [the ranks that part from the lowest rank holding it]}}.
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
from networks.blocks import SequenceRegion

FILE = "fingerprints.json"
PASSES = ("grad", "update")  # in the order a step computes them
ACTIVATION_PASSES = ("forward", "out_grad")
WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod"}  # levels that wrappers add to module names
BLOCK_PARTS = 3  # blocks.<i>.<part>: a block's norms, attention and MLP; blocks.<i>.attn.attend: its core

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
    recorder = getattr(trainer, "activation_recorder", None)
    acts = recorder.take(step == trainer.tc.fingerprint_steps) if recorder else None
    if acts is not None:  # which samples this rank's outputs cover: parts of other dp slices always add up (cp
        acts["slice"] = trainer.grid.batch.rank  # ranks may hold copies: the outputs before the sequence is split)
    mine = {"params": mine, "acts": acts}
    world = trainer.grid.world
    entries = [mine] if world.size == 1 else gather_objects(mine, world.group)
    if trainer.grid.is_main:
        write_step(Path(trainer.run_dir) / FILE, step, entries, trainer.cfg.precision.mode, trainer.grid.signature)


@contextmanager
def recording(trainer, step: int) -> Iterator[None]:
    """Around the forward and backward of `step` (counted from 1): the activations of the fingerprinted steps
    (the module docstring); the recorder is made at the first and its hooks removed after the last."""
    if step > trainer.tc.fingerprint_steps or trainer.cfg.precision.compile:
        yield
        return
    if getattr(trainer, "activation_recorder", None) is None:
        trainer.activation_recorder = ActivationRecorder(trainer.raw_model, trainer.pipeline)
    trainer.activation_recorder.active = True
    try:
        yield
    finally:
        trainer.activation_recorder.active = False


def module_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def recorded_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules whose outputs are recorded, by single-process name (the outermost of a wrapped module)."""
    picked: dict[str, torch.nn.Module] = {}
    for raw, module in model.named_modules():
        name = module_name(raw)
        parts, has_params = name.split("."), any(True for _ in module.parameters())
        if not name or name in picked or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        top = len(parts) == 1 and has_params and name != "criterion"
        block = parts[0] == "blocks" and (len(parts) == 2 or (len(parts) == BLOCK_PARTS and has_params)
                                          or parts[2:] == ["attn", "attend"])
        if (top or block) and not isinstance(module, (torch.nn.Dropout, SequenceRegion)):
            picked[name] = module
    return picked


def output_order(names: list[str]) -> list[tuple[int, int]]:
    """Sort keys that put modules (listed parents first, as `named_modules` does) in the order their outputs
    are computed: a parent after its last descendant, and of those the deeper first."""
    keys = []
    for i, name in enumerate(names):
        last = max((j for j in range(i, len(names)) if names[j].startswith(name + ".")), default=i)
        keys.append((last, -name.count(".")))
    return keys


class ActivationRecorder:
    """Forward hooks on `recorded_modules(model)` that sum each output's and its gradient's statistics while
    `active`; `take()` returns {"stats": {pass: {module: [sum, sumsq, abssum]}}, "where": {module: (stage,
    index)}} and starts the next step from zero."""

    def __init__(self, model: torch.nn.Module, pipeline):
        modules = recorded_modules(model)
        stage_of: dict[int, int] = {}
        for stage in pipeline.stages if pipeline is not None else ():
            for module in stage.submod.modules():
                stage_of[id(module)] = min(stage_of.get(id(module), stage.submod.index), stage.submod.index)
        self.where = {name: (stage_of.get(id(m), 0), *finish) for name, m, finish in zip(
            modules, modules.values(), output_order(list(modules)), strict=True)}
        self.totals: dict[tuple[str, str], torch.Tensor] = {}
        self.active = False
        self.handles = [m.register_forward_hook(self.hook(name)) for name, m in modules.items()]

    def hook(self, name: str):
        def record(module, args, output) -> None:
            # a recomputation under activation checkpointing runs inside the backward: counted once already
            if not self.active or not isinstance(output, torch.Tensor) or torch._C._current_graph_task_id() != -1:
                return
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
                return  # not per sample (a learned position embedding's lookup: the same for every micro-batch)
            self.add("forward", name, output)
            if output.requires_grad:
                seen: list[bool] = []  # once per output (a split backward may visit it again for the weights)

                def on_grad(grad: torch.Tensor) -> None:
                    if not seen:
                        seen.append(True)
                        self.add("out_grad", name, grad)
                output.register_hook(on_grad)
        return record

    def add(self, kind: str, name: str, tensor: torch.Tensor) -> None:
        x = tensor.detach().to(torch.float64)
        row = torch.stack([x.sum(), (x * x).sum(), x.abs().sum()])
        key = (kind, name)
        self.totals[key] = self.totals[key] + row if key in self.totals else row

    def take(self, last: bool) -> dict:
        stats: dict[str, dict[str, list[float]]] = {kind: {} for kind in ACTIVATION_PASSES}
        for (kind, name), row in self.totals.items():
            stats[kind][name] = row.cpu().tolist()
        self.totals = {}
        if last:
            for handle in self.handles:
                handle.remove()
        return {"stats": stats, "where": self.where}


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


def merge_activations(acts: list[dict | None]) -> tuple[dict[str, dict[str, list[float]]], list[str]]:
    """Every rank's activation statistics -> ({pass: {module: statistics of the single-process tensor}},
    modules in definition order): the distinct statistics of a module's output add up (the parts ranks
    hold), identical ones count once (the copies of a replicated output: over tp without sp, over cp before the
    sequence is split) among the ranks of one slice of the batch (`slice`, the dp rank: other samples, whose
    statistics add up even where they happen to be equal, as the positions of two dp ranks' packed rows can be)."""
    distinct: dict[str, dict[str, set]] = {kind: {} for kind in ACTIVATION_PASSES}
    where: dict[str, tuple] = {}
    for rank in filter(None, acts):
        for name, defined in rank["where"].items():
            where[name] = min(where.get(name, tuple(defined)), tuple(defined))
        for kind in ACTIVATION_PASSES:
            for name, row in rank["stats"][kind].items():
                distinct[kind].setdefault(name, set()).add((rank.get("slice", 0), tuple(row)))
    totals = {kind: {name: [sum(col) for col in zip(*(row for _, row in rows))]
                     for name, rows in distinct[kind].items()} for kind in ACTIVATION_PASSES}
    return totals, sorted(where, key=where.__getitem__)


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


def disagreeing_replicas(entries: list[list[Entry]]) -> dict[str, dict[str, list[int]]]:
    """{pass: {parameter: [ranks]}}: the ranks whose copy of a box (a dp or cp replica, a tp rank's copy of a
    norm) has statistics other than the lowest rank holding it. Copies are reduced or computed alike, so
    they agree bitwise; a rank that parts from its replicas is named (empty when all agree)."""
    first: dict[tuple, dict] = {}
    parted: dict[str, dict[str, list[int]]] = {}
    for rank, rank_entries in enumerate(entries):
        for name, offsets, shape, _, stats in rank_entries:
            box = (name, tuple(offsets), tuple(shape))
            reference = first.setdefault(box, stats)
            for kind in PASSES:
                if reference is not stats and list(stats[kind]) != list(reference[kind]):
                    ranks = parted.setdefault(kind, {}).setdefault(name, [])
                    ranks.extend([] if rank in ranks else [rank])
    return parted


def write_step(path: Path, step: int, entries: list[list[Entry]], precision: str, layout: str) -> None:
    """Add `step` to `path` (a new file at step 1, or when none exists), atomically."""
    totals, order = merge([rank["params"] for rank in entries])
    replicas = disagreeing_replicas([rank["params"] for rank in entries])
    totals |= {"replicas": replicas} if replicas else {}
    record = {"precision": precision, "layout": layout, "order": order, "steps": {}}
    if entries[0]["acts"] is not None:
        activations, record["modules"] = merge_activations([rank["acts"] for rank in entries])
        totals |= activations
    if step > 1 and path.is_file():
        record["steps"] = json.loads(path.read_text())["steps"]
    record["steps"][str(step)] = totals
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
