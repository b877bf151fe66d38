"""Where two runs part: `python -m utils.compare --diverge RUN_A RUN_B [--rtol R]`.

Reads the `fingerprints.json` both runs wrote (`trainer.fingerprint_steps=N`, utils/engine/fingerprints.py:
per parameter and step, [sum, sum of squares, sum of |x|] of the full gradient before clipping and of the
update u, and for the update also [sum of u*g, sum of |u*g|] with its gradient g) and scans them in the
order a defect shows: step by step, and in each step the passes in the order the step computes them: the
forward outputs of the model's parts in definition order (a defect in a forward shows first at the module
that has it and flows to the output from there), the parameters' gradients in backward order (the reverse:
a defect in a backward shows first at the parameters of the module that has it), the gradients arriving at
the parts' outputs in backward order (they show a backward defect one module early, at the output feeding
the module that has it, so they come after the parameters), then the updates. The first module (or
parameter) whose statistics differ beyond the relative tolerance is the first divergence; a parameter's
module is its name without the last component. Runs recorded without activations (under compile, or by
an older version) are scanned over their parameters only.

The output gradients carry each layout's loss normalisation (a dp rank's loss is its own batch's mean), one
factor per step: they are divided by the sum of |x| of the step's last recorded output gradient (the
model's output: the first the backward computes) before they are compared.

A statistic's deviation is |a - b| over its scale: for the sum of squares and of |x|, the larger of the
two; for the sum, the larger sum of |x| (a sum that cancels to near zero is only as exact as the values
it adds). The gradient is judged by those three, the update by sum(u*g) and sum(|u*g|) over the larger
sum(|u*g|): Adam moves an element whose gradient is zero in exact arithmetic (an attention key bias) by
rounding noise of either sign, which its plain statistics count in full (measured: 1.2e-1 under bf16 tp2
where the gradients agree to 4e-3) and u*g weighs at nothing.

The default tolerance is that of the looser precision of the two runs, for the runs' model (task.json's arch,
beside fingerprints.json), per pass, from the spread report tests/data/spread.json (`python -m tests.spread`, the
bounds docs/testing.md tabulates): fp32 1e-4 (the layout contract); bf16 and fp16 five times the largest deviation
of that pass's fingerprints (forward outputs, gradients, output gradients, updates) in any correct layout of the
combination matrix from its single-process run, per model (a parameter's gradient moves more than the loss: the
matrix's curve bounds would name rounding as a divergence); a model the report lacks, or runs without a
task.json, get the loosest bound of their precision; tf32 that of fp16 (the same 10 bits of mantissa; a CPU
has no tf32), a precision the report lacks the loosest of all. `--rtol R` sets one bound for every pass.
A parameter (or module output) that one run records and the other lacks, at a step both recorded, is a
divergence at once (deviation inf, the run that lacks it named): a layout that drops a parameter's gradient
or update has lost it, not agreed on it.
Exit status: 0 when the runs agree over the steps both recorded, 1 when they part, 2 (one line) when a
run has no fingerprints, the two share no parameter or step or train different models, or (without --rtol)
the spread report is missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from utils import ConfigError, exit_bad_input, require

FILE = "fingerprints.json"  # utils/engine/fingerprints.py FILE (not imported: this tool loads no torch)
PASSES = {"forward": "forward", "grad": "gradient", "out_grad": "output-gradient", "update": "update"}  # scan order
ACTIVATIONS = ("forward", "out_grad")  # by module (utils/engine/fingerprints.py ActivationRecorder)
SPREAD_REPORT = Path(__file__).resolve().parents[2] / "tests" / "data" / "spread.json"  # tests/spread.py writes it
TASK_FILE = "task.json"  # utils/checkpoints/run_dir.py TASK_FILE: the run's model family ("arch")
SAME_MANTISSA = {"tf32": "fp16"}  # a precision the report cannot measure on a CPU: the one of its rounding
STATS = ("sum", "sumsq", "abssum", "sum u*g", "sum |u*g|")
SHOWN = 8  # parameters listed for the pass that parts


@dataclass(frozen=True)
class Finding:
    """One parameter of one pass of one step that differs beyond the tolerance."""

    step: int
    kind: str  # a key of PASSES
    name: str
    deviation: float
    a: list[float]
    b: list[float]

    @property
    def module(self) -> str:
        return self.name if self.kind in ACTIVATIONS else self.name.rpartition(".")[0] or self.name

    ranks: str = ""  # the ranks whose copies of the parameter part from their replicas, by run
    missing: str = ""  # "A" or "B": the run that did not record it (its statistics are [])

    def where(self) -> str:
        tail = "" if self.kind in ACTIVATIONS else f" (parameter {self.name})"
        lacks = f", missing from {self.missing}" if self.missing else ""
        return f"step {self.step}, {PASSES[self.kind]} pass, module {self.module}{tail}{self.ranks}{lacks}"

    def line(self) -> str:
        if self.missing:
            return f"  {self.name}: recorded by {'B' if self.missing == 'A' else 'A'} only, missing from {self.missing}"
        values = "  ".join(f"{s} {x:.6g} vs {y:.6g}" for s, x, y in zip(STATS, self.a, self.b))
        return f"  {self.name}: deviation {self.deviation:.2e}  ({values})"


def load(run: str | Path) -> dict:
    """A run directory's (or a file's) fingerprints, with "model": the run's model family (its task.json's
    arch; None without one); ConfigError when there are none."""
    path = Path(run)
    require(path.exists(), f"no run directory {path}", "RUN_DIR", "give the run.dir of a run")
    path = path / FILE if path.is_dir() else path
    require(path.is_file(), f"{path} does not exist (the run recorded no fingerprints)", "trainer.fingerprint_steps",
            "train both runs with trainer.fingerprint_steps=N (e.g. 2) to record their first N steps")
    task = path.parent / TASK_FILE
    model = json.loads(task.read_text()).get("arch") if task.is_file() else None
    return {**json.loads(path.read_text()), "model": model}


def deviation(a: list[float], b: list[float]) -> float:
    """The largest scaled difference of a gradient's [sum, sumsq, abssum], or of an update's [sum(u*g),
    sum(|u*g|)] (its last two; see the module docstring); inf for a NaN."""
    if len(a) == len(b) == 5:
        pairs = [(a[3], b[3], max(a[4], b[4])), (a[4], b[4], max(a[4], b[4]))]
    else:
        pairs = [(a[0], b[0], max(a[2], b[2])), (a[1], b[1], max(a[1], b[1])), (a[2], b[2], max(a[2], b[2]))]
    worst = 0.0
    for x, y, scale in pairs:
        diff = abs(x - y)
        if math.isnan(diff) or math.isnan(scale):
            return float("inf")
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def bounds(report: Path | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{model: {precision: {pass: relative bound}}} of the localiser, from the spread report (module docstring)."""
    report = SPREAD_REPORT if report is None else report
    require(report.is_file(), f"no spread report {report} to take the tolerance from", "--rtol",
            "give --rtol R, or derive the report: python -m tests.spread")
    return json.loads(report.read_text())["bounds"]["localiser"]


def rtol_of(precision: str, model: str | None, table: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """{pass: bound} of one run: its model's at its precision, else the loosest of its precision over the models,
    else of every precision; a pass the report lacks gets the loosest of the others."""
    precision = SAME_MANTISSA.get(precision, precision)
    rows = ([table[model][precision]] if model in table and precision in table[model] else
            [row[precision] for row in table.values() if precision in row]
            or [by for row in table.values() for by in row.values()])
    found = {kind: max(row[kind] for row in rows if kind in row) for kind in PASSES if any(kind in r for r in rows)}
    return {kind: found.get(kind, max(found.values())) for kind in PASSES}


def tolerances(fa: dict, fb: dict, rtol: float | None) -> dict[str, float]:
    """{pass: the relative bound the scan judges it by}: `rtol` for every pass, else the looser run's."""
    if rtol is not None:
        return dict.fromkeys(PASSES, rtol)
    table = bounds()
    a, b = (rtol_of(f["precision"], f.get("model"), table) for f in (fa, fb))
    return {kind: max(a[kind], b[kind]) for kind in PASSES}


def tolerance(fa: dict, fb: dict, rtol: float | None) -> float:
    """The loosest pass's bound (`tolerances`)."""
    return max(tolerances(fa, fb, rtol).values())


def check_comparable(fa: dict, fb: dict) -> list[int]:
    """The steps both recorded; ConfigError when the runs train different models (task.json), share no
    parameter or no step. Parameters only one run records are the scan's to report."""
    models = {fa.get("model"), fb.get("model")} - {None}
    require(len(models) <= 1, f"the runs train different models ({' and '.join(sorted(models))})", "RUN_DIR",
            "compare two runs of the same model")
    require(bool(set(fa["order"]) & set(fb["order"])), "the runs record no parameter in common", "RUN_DIR",
            "compare two runs of the same model")
    steps = sorted(set(map(int, fa["steps"])) & set(map(int, fb["steps"])))
    require(bool(steps), "the runs have no fingerprinted step in common", "trainer.fingerprint_steps",
            "record the same first steps in both runs")
    return steps


def normalised(stats: dict[str, list[float]], modules: list[str]) -> dict[str, list[float]]:
    """Output-gradient statistics divided by the last recorded module's sum of |x| (the step's one factor)."""
    last = next((m for m in reversed(modules) if m in stats), None)
    scale = stats[last][2] if last is not None and stats[last][2] > 0 else 1.0
    return {name: [row[0] / scale, row[1] / scale**2, row[2] / scale] for name, row in stats.items()}


def pass_values(f: dict, step: int, kind: str) -> dict[str, list[float]]:
    values = f["steps"][str(step)][kind]
    return normalised(values, f["modules"]) if kind == "out_grad" else values


def parted_ranks(fa: dict, fb: dict, step: int, kind: str, name: str) -> str:
    """', on rank 1 of B' where a run's copies of a parameter part from their replicas at this pass (the
    rank where that run went its own way), else ''."""
    said = []
    for label, f in (("A", fa), ("B", fb)):
        ranks = f["steps"][str(step)].get("replicas", {}).get(kind, {}).get(name)
        if ranks:
            said.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {label}")
    return f", on {' and '.join(said)}" if said else ""


def union(first: list[str], second: list[str]) -> list[str]:
    """`first`, then the names of `second` it lacks, each after the name `second` holds before it."""
    merged, known = list(first), set(first)
    for i, name in enumerate(second):
        if name not in known:
            before = next((merged.index(n) for n in reversed(second[:i]) if n in known), -1)
            merged.insert(before + 1, name)
            known.add(name)
    return merged


def scan_order(fa: dict, fb: dict) -> dict[str, list[str]]:
    """The names each pass compares, in the order it is scanned (those of either run); no activation pass
    unless both recorded one."""
    backward = list(reversed(union(fa["order"], fb["order"])))
    names = {"grad": backward, "update": backward}
    if "modules" in fa and "modules" in fb:
        modules = union(fa["modules"], fb["modules"])
        names |= {"forward": modules, "out_grad": list(reversed(modules))}
    return {kind: names[kind] for kind in PASSES if kind in names}


def scan(fa: dict, fb: dict, rtol: float | dict[str, float]) -> list[tuple[int, str, list[Finding], tuple[float, str]]]:
    """(step, pass, findings in scan order, (worst deviation, its module or parameter)) of each pass, in
    order, up to and including the first that has findings; `rtol` one bound, or one per pass (`tolerances`)."""
    steps, order = check_comparable(fa, fb), scan_order(fa, fb)
    passes = []
    for step in steps:
        for kind, names in order.items():
            a, b = pass_values(fa, step, kind), pass_values(fb, step, kind)
            # an output without a gradient has none recorded in either run; one that only one run records parts
            names = [n for n in names if n in a or n in b]
            deviations = [(deviation(a[name], b[name]) if name in a and name in b else math.inf, name)
                          for name in names]
            # a rank whose copy parts from its replicas is a divergence even where the copy counted agrees
            ranks = {name: parted_ranks(fa, fb, step, kind, name) for _, name in deviations}
            bound = rtol[kind] if isinstance(rtol, dict) else rtol
            findings = [Finding(step, kind, name, d, a.get(name, []), b.get(name, []), ranks[name],
                                "" if name in a and name in b else "B" if name in a else "A")
                        for d, name in deviations if not d <= bound or ranks[name]]
            passes.append((step, kind, findings, max(deviations, default=(0.0, ""))))
            if findings:
                return passes
    return passes


def first_divergence(path_a: str | Path, path_b: str | Path, rtol: float | None = None) -> str | None:
    """'step S, <pass> pass, module M (parameter P)' where the two runs first part, or None."""
    fa, fb = load(path_a), load(path_b)
    check_comparable(fa, fb)  # before the tolerance: runs of two models have none
    passes = scan(fa, fb, tolerances(fa, fb, rtol))
    findings = passes[-1][2] if passes else []
    return findings[0].where() if findings else None


def report(run_a: str, run_b: str, rtol: float | None) -> int:
    """Print the scan, one line per pass and per parameter that parts; 1 when the runs part, else 0."""
    try:
        fa, fb = load(run_a), load(run_b)
        check_comparable(fa, fb)
        limits = tolerances(fa, fb, rtol)
        passes = scan(fa, fb, limits)
    except ConfigError as err:
        exit_bad_input(err)
    print(f"A: {run_a} ({fa['layout']}, {fa['precision']})\nB: {run_b} ({fb['layout']}, {fb['precision']})")
    order = scan_order(fa, fb)
    modules = f"{len(order['forward'])} modules' outputs and " if "forward" in order else "no activations (not both "
    modules += "" if "forward" in order else "recorded them), "
    order_bounds = [limits[kind] for kind in order]
    said = (f"relative tolerance {order_bounds[0]:.1e}" if len(set(order_bounds)) == 1 else "relative tolerances "
            + ", ".join(f"{PASSES[kind]} {limits[kind]:.1e}" for kind in order))
    print(f"{said}, {modules}{len(fa['order'])} parameters")
    for step, kind, findings, (worst, name) in passes:
        verdict = f"{len(findings)} of {len(order[kind])} part" if findings else "agree"
        print(f"step {step} {PASSES[kind]}: {verdict} (largest deviation {worst:.2e}, {name})")
        for finding in findings[:SHOWN]:
            print(finding.line())
        if len(findings) > SHOWN:
            print(f"  ... and {len(findings) - SHOWN} more")
    findings = passes[-1][2] if passes else []
    if not findings:
        print(f"no divergence over {len(passes) // len(order)} steps")
        return 0
    first = findings[0]
    bound = limits[first.kind]
    versus = "> " if first.deviation > bound else "<= "  # a replica that parts, where the copy counted agrees
    print(f"first divergence: {first.where()}, deviation {first.deviation:.2e} {versus}{bound:.1e}")
    return 1
