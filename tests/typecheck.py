"""SPMD types, the second oracle: `python -m tests.typecheck [CASE-NAME-PART ...] [--plants [NAME ...]] [--rank R]`.

Type-checks ONE training step (forward, backward, gradient sync) of every layout of the matrix's covering set
(tests/matrix.py, tests/data/matrix_cases.json) in this one process: rank 0 (and `--rank`) of a fake process group
of the case's world size, the model built as the trainer builds it (utils/engine/build.py through
utils/plan/step.py's fake world), tiny batch, real values. The types are distributed/typecheck/spmd_typing.py's
(meta-pytorch's spmd-types); a case passes, fails with the SpmdTypeError and where it arose, or is skipped with
the reason.

`--plants`: each plant of tests/planted_bugs.py (or those named) is applied to a copy of the tree by the harness's
own `copy_tree`/`plant`, and this module runs there on the plant's target layouts: a plant is caught when a target
layout that passes unplanted fails its type check. Results: docs/testing.md, "SPMD types: the second oracle".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Verdict:
    case: str
    status: str  # passed | type error | skipped | crashed
    detail: str = ""
    seconds: float = 0.0
    backward_checks: int = 0

    def line(self) -> str:
        return f"{self.status:10} {self.case} ({self.seconds:.1f} s, {self.backward_checks} backwards)" + \
            (f": {self.detail}" if self.detail else "")


def folded(case):
    """The case with its pipeline folded (pp=1): every stage of the model on one rank, chained in one forward and
    backward, the tp/cp/dp layout unchanged. The pipeline's point-to-point transfers do not run on a fake group with
    values (a fake recv fills nothing: the schedule allocates garbage shapes), so a pp case is typed folded; what
    pp itself adds (sends between stages, the schedule's loss scaling, the tied embedding's sum over the pipeline's
    ends) is left out: point-to-point moves a value unchanged, the rest is arithmetic on already typed values."""
    import dataclasses

    return dataclasses.replace(case, pp=1, schedule=None) if case.pp > 1 else case


def tiny_overrides(case) -> list[str]:
    """The case's settings on the smallest batch its layout accepts: one sample per data-parallel rank and
    micro-batch, a narrower model."""
    from tests.matrix import MODEL_ARGS

    batch = case.dp * case.grad_accum_steps
    args = [a for a in MODEL_ARGS[case.model] if not a.startswith("trainer.global_batch_size")]
    return args + case.overrides() + [f"trainer.global_batch_size={batch}", "model.embed_dim=32"]


def check_case(case, rank: int = 0) -> Verdict:
    """One training step of `case` at global rank `rank` of a fake group of case.world ranks, types on."""
    import logging

    import torch

    from distributed.typecheck import spmd_typing
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.engine.build import build_trainer
    from utils.plan.probe import data_less_task
    from utils.plan.step import fake_world

    start = time.perf_counter()
    name, case = case.name, folded(case)
    note = "pp folded: " if case.name != name else ""
    cfg = load_config(tiny_overrides(case))[0]
    spmd = _spmd()
    with fake_world(case.world, rank), tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grid = init_grid(cfg.parallel)
        trainer = build_trainer(cfg, data_less_task(cfg, None), grid, logging.getLogger("typecheck"), Path(tmp))
        try:
            x, y = trainer.task.example_batch(cfg.trainer.global_batch_size // grid.batch.size, grid.device)
            with spmd_typing.checking(grid) as session, TypedModel(session, trainer.raw_model) as typed:
                _type_losses(trainer, spmd_typing)
                try:
                    trainer.train_step(x, y)
                except spmd.SpmdTypeError as err:
                    return Verdict(name, "type error", note + _where(err), time.perf_counter() - start,
                                   session.backward_checks)
                missing = typed.unsummed()
                if missing:
                    return Verdict(name, "type error", note + "gradient sync: " + "; ".join(missing[:3]),
                                   time.perf_counter() - start, session.backward_checks)
                return Verdict(name, "passed", note.rstrip(": "), time.perf_counter() - start,
                               session.backward_checks)
        finally:
            trainer.tb.close()
            torch.set_default_dtype(torch.float32)


def _type_losses(trainer, spmd_typing) -> None:
    """The step's forward and loss, per micro-batch, in a typed region (the batch typed there); the loss checked."""
    real = trainer.task.training_loss

    def training_loss(model, criterion, x, y, step):
        with spmd_typing.typed_forward((x, y)):
            loss = real(model, criterion, x, y, step)
            spmd_typing.check_loss(loss)
        return loss

    trainer.task.training_loss = training_loss


# ----------------------------------------------------------------------------------------------------------------
# The model's parameters, FSDP's and DDP's identity Functions, the gradient sync


class TypedModel:
    """Types this rank's model's parameters from the layers' declarations (on tp: sharded `shard_dims` V, declared
    partial `partial_grad_params` R, the rest I; on cp every parameter R: each rank's tokens give a partial
    gradient, summed by DDP/FSDP over dp x cp, which is not typed), at each module's forward (FSDP's unsharded
    parameters too); types FSDP's and DDP's identity Functions as pass-through; and follows the gradient sync: an R
    parameter's gradient is P (a pending sum) until `sum_grads` reduces it over that axis."""

    def __init__(self, session, model):
        from distributed.typecheck import spmd_typing as st

        self.st, self.session, self.model = st, session, model
        self.types, self.partial = {}, {}
        self.summed, self.seen = {}, set()
        tp, cp = session.axes.get("tp"), session.axes.get("cp")
        for mod_name, module in model.named_modules():
            dims = getattr(module, "shard_dims", {}) if tp is not None and getattr(module, "axis", None) is tp else {}
            declared = {id(p) for p in module.partial_grad_params()} if hasattr(module, "partial_grad_params") else ()
            for name, p in module.named_parameters(recurse=False):
                t = {"tp": "V" if name in dims else "R" if id(p) in declared else "I"} if tp is not None else {}
                t.update({"cp": "R"} if cp is not None else {})
                self.types.setdefault(id(p), t)
                if t.get("tp") == "R":
                    self.partial[id(p)] = f"{mod_name}.{name}".lstrip(".")

    def __enter__(self):
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
        import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
        import torch.nn.parallel.distributed as ddp

        import distributed.data_parallel as data_parallel

        patch = self.session.patch
        for cls, rule in ((fsdp_group.RegisterPostBackwardFunction, _pass_inputs),
                          (fsdp_state.RegisterPreBackwardFunction, _pass_output), (ddp._DDPSink, _pass_inputs)):
            patch(cls, "spmd_typecheck", staticmethod(rule))
        patch(data_parallel, "sum_grads", self._sum_grads(data_parallel.sum_grads))
        self.hooks = []
        for module in self.model.modules():
            keys = {n: id(p) for n, p in module.named_parameters(recurse=False)}
            self.hooks.append(module.register_forward_pre_hook(lambda m, args, keys=keys: self._stamp(m, keys)))
        for p in self.model.parameters():
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(lambda q: self.seen.add(id(q))))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def _stamp(self, module, keys: dict) -> None:
        spmd = _spmd()
        if not spmd.is_type_checking():
            return
        for name, p in module.named_parameters(recurse=False):
            t = self.types.get(keys.get(name))
            if t:  # once per tensor object; a later stamp must agree with the first
                spmd.assert_type(p, {self.session.axes[a].group: self.st._t(v) for a, v in t.items()})

    def _sum_grads(self, real):
        def sum_grads(params, axis):
            for p in params:
                if p.grad is not None:
                    self.summed.setdefault(id(p), set()).add(axis.name)
            return real(params, axis)
        return sum_grads

    def unsummed(self) -> list[str]:
        """Parameters R on tp whose P gradient reached the optimizer without sum_grads over tp."""
        tp = self.session.axes.get("tp")
        return [f"{self.partial[id(p)]}: R on tp, so its gradient is {_spmd().R.backward_type()!r} (a pending sum), "
                "and it reached the optimizer without sum_grads over tp" for p in self.model.parameters()
                if id(p) in self.partial and id(p) in self.seen and tp.name not in self.summed.get(id(p), ())]


def _copy_types(outputs, inputs) -> None:
    """Output i gets input i's type (FSDP's and DDP's identity Functions around a module's inputs or outputs)."""
    import torch
    from spmd_types.runtime import _set_local_type

    spmd = _spmd()
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    ins = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    spmd.rules.ignore(*[t for t in ins if isinstance(t, torch.Tensor)])
    for o, i in zip(outs, ins):
        if isinstance(o, torch.Tensor):
            typed = isinstance(i, torch.Tensor) and spmd.has_local_type(i)
            _set_local_type(o, dict(spmd.get_local_type(i)) if typed else {})


def _pass_inputs(outputs, *, inputs):
    _copy_types(outputs, inputs)


def _pass_output(outputs, *, output):
    _copy_types(outputs, output)


def _spmd():
    import spmd_types
    import spmd_types.checker  # noqa: F401 (the checking mode)

    return spmd_types


def _where(err: Exception) -> str:
    """The error's first line and the innermost frame of this repository's code that raised it."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if str(ROOT) in f.filename and "spmd_typing" not in f.filename and "typecheck" not in f.filename]
    where = f" at {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno} ({frames[-1].name})" if frames \
        else ""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:400] + where


def covering_cases(parts: list[str] | None = None):
    from tests.matrix import covering_set

    accepted, _ = covering_set()
    return [c for c in accepted if not parts or any(p in c.name for p in parts)]


def run(cases, rank: int = 0, out=print) -> list[Verdict]:
    verdicts = []
    for case in cases:
        try:
            verdict = check_case(case, rank)
        except Exception as err:  # a crash is a verdict too: the checker could not run the layout
            verdict = Verdict(case.name, "crashed", f"{type(err).__name__}: {_where(err)}")
        verdicts.append(verdict)
        out(verdict.line())
    return verdicts


# ----------------------------------------------------------------------------------------------------------------
# Plants


@contextlib.contextmanager
def planted(edits):
    """A plant of tests/planted_bugs.py in this process: its edits (as `planted_bugs.locate` finds them by their
    markers) are applied by the harness's own `plant` to a copy of the files they touch (each text must match exactly
    once), and the planted code of every function and method is swapped into the live ones (`__code__`; names the
    plant imports are added to the module), restored on exit."""
    from tests import planted_bugs

    swaps, added = [], []
    files = sorted({file for file, _, _ in edits})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            for file in files:
                (tree / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / file, tree / file)
            planted_bugs.plant(tree, edits)
            for file in files:
                module = importlib.import_module(file[:-3].replace("/", "."))
                namespace = dict(module.__dict__)
                exec(compile((tree / file).read_text(), str(ROOT / file), "exec"), namespace)
                for name, new in namespace.items():
                    if name not in module.__dict__:
                        module.__dict__[name] = new
                        added.append((module, name))
                    old = module.__dict__[name]
                    if inspect.isclass(old) and inspect.isclass(new) and old is not new:
                        for attr, member in vars(new).items():
                            _swap(vars(old).get(attr), member, swaps)
                    else:
                        _swap(old, new, swaps)
        yield
    finally:
        for fn, code in reversed(swaps):
            fn.__code__ = code
        for module, name in added:
            module.__dict__.pop(name, None)


def _swap(old, new, swaps: list) -> None:
    old, new = (m.__func__ if isinstance(m, (staticmethod, classmethod)) else m for m in (old, new))
    if inspect.isfunction(old) and inspect.isfunction(new) and old.__code__ is not new.__code__ \
            and old.__code__ != new.__code__:
        swaps.append((old, old.__code__))
        old.__code__ = new.__code__


def plant_verdict(name: str, limit: int | None = None, baseline: dict | None = None) -> dict:
    """Whether the types catch plant `name` alone: its target layouts (tests/planted_bugs.py's order, fp32 and
    small worlds first; at most `limit`) type-checked with the plant in place; caught where a layout that passes
    unplanted fails. Returns {'caught': [(case, detail)], 'passed': [...], 'other': [(case, status, detail)]}."""
    from tests import planted_bugs

    p = planted_bugs.PLANTS[name]
    names = [c for test, c in planted_bugs.targeted(p) if test == planted_bugs.ACCEPTED_TEST][:limit]
    cases = {c.name: c for c in covering_cases()}
    found = {"caught": [], "passed": [], "other": [], "targets": len(names)}
    with planted(planted_bugs.locate(name)), tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "hit"
        saved, os.environ[planted_bugs.MARKER_VAR] = os.environ.get(planted_bugs.MARKER_VAR), str(marker)
        try:
            planted_runs = run([cases[n] for n in names], out=lambda line: None)
        finally:
            os.environ.pop(planted_bugs.MARKER_VAR) if saved is None else os.environ.update({
                planted_bugs.MARKER_VAR: saved})
        found["ran"] = marker.exists()  # the planted code ran in some target's step
    for v in planted_runs:
        clean = (baseline or {}).get(v.case) or run([cases[v.case]], out=lambda line: None)[0]
        if v.status == "type error" and clean.status == "passed":
            found["caught"].append((v.case, v.detail))
        elif v.status == "passed":
            found["passed"].append(v.case)
        else:
            found["other"].append((v.case, v.status, v.detail))
    return found


def plant_report(names: list[str] | None = None, limit: int | None = None, out=print) -> dict[str, dict]:
    from tests import planted_bugs

    baseline = {v.case: v for v in run(covering_cases(), out=lambda line: None)}
    results = {}
    for name in planted_bugs.PLANTS:
        if names and name not in names:
            continue
        found = results[name] = plant_verdict(name, limit, baseline)
        checked = len(found["caught"]) + len(found["passed"]) + len(found["other"])
        verdict = "CAUGHT" if found["caught"] else "missed" if found["ran"] else "not run"
        detail = found["caught"][0][1] if found["caught"] else ""
        out(f"{name:40} {verdict} on {len(found['caught'])}/{checked} targets checked ({found['targets']} targets)"
            + (f": {found['caught'][0][0]}: {detail}" if detail else "")
            + (f"; other: {found['other'][:2]}" if found["other"] else ""))
    return results


def main(argv: list[str]) -> int:
    if "--plants" in argv:
        names = [a for a in argv[argv.index("--plants") + 1:] if not a.startswith("--")]
        limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else None
        names = [n for n in names if not n.isdigit()]
        plant_report(names or None, limit)
        return 0
    rank = int(argv[argv.index("--rank") + 1]) if "--rank" in argv else 0
    as_json = "--json" in argv
    parts = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--rank")]
    cases = covering_cases(parts or None)
    if parts:
        cases = [c for c in cases if c.name in parts] or cases
    verdicts = run(cases, rank, out=(lambda line: print(line, file=sys.stderr)) if as_json else print)
    if as_json:
        print(json.dumps({v.case: {"status": v.status, "detail": v.detail} for v in verdicts}))
    else:
        counts = {s: sum(v.status == s for v in verdicts) for s in ("passed", "type error", "skipped", "crashed")}
        print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if any(v.status in ("type error", "crashed") for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
