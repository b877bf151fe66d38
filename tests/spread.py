"""The spread of correct layouts, measured, and the bounds derived from it: `python -m tests.spread`.

    python -m tests.spread [--models vit gpt llama] [--precisions fp32 bf16 fp16] [--at-least K]
                           [--random N] [--seed S] [--margin M] [--out FILE] [--keep DIR [--reuse]]

Runs the accepted cases of the combination matrix's covering set (tests/matrix.py; those of the chosen models
and precisions) and seeded random accepted cases of the whole space (`random_cases`: first those that bring each
(model, precision) pair to at least K measured cases, then N more) through the matrix's own code path: a nested
pytest on the covering set's `test_accepted_combination_follows_the_single_process_run` and, for the random cases,
`test_measured_case` below, which calls the same `check_case` (tests/test_matrix.py), each case against the
single-process run of its model, precision, accumulation and packing, with `DLSCALE_MATRIX_REPORT` set (the
worst deviation `check_case` writes). Every run also records fingerprints of its STEPS steps (the matrix's
FINGERPRINTED, added to its COMMON for this process: the curves are bitwise those of a run without them, measured
on a bf16 and an fp16 case on 2026-12-07), so each case also gives the worst deviation of a parameter's gradient,
update or a module's output or output gradient from the single-process run (utils/compare/diverge.py's `scan`).

The report, FILE (tests/data/spread.json): per case its name, model, precision, worst relative deviation of the
loss, the grad norm and the validation loss (and of all three: the figure `check_case` reports) and, per
fingerprint pass, the worst deviation and where; the machine (CPU model, its AVX-512 flags, cores), torch,
the date, the commit, STEPS and the validation setting of each model; per (model, precision) the spread (the
largest deviation over its cases) and the bounds derived from it (`derive`):
- the matrix's curve bounds (tests/test_matrix.py `tolerance`): fp32 FP32_BOUND, the layout contract, whatever
  the spread (the measured fp32 spread must be at least MARGIN times inside it); bf16 and fp16 MARGIN x spread;
- the localiser's bounds (utils/compare/diverge.py), per fingerprint pass (forward, gradient, output gradient,
  update: their statistics round differently): fp32 FP32_BOUND; bf16 and fp16 MARGIN x the pass's fingerprint
  spread (a parameter's gradient moves more than the loss: the curve bounds would name rounding as a divergence),
  leaving out what parts beyond FP32_BOUND in fp32 correct layouts (`artefacts`: not rounding).
With --models or --precisions, the cases of the other pairs are kept from FILE (their run's facts with them).
tests/test_spread.py checks that the stored bounds are those `derive` makes of the stored cases, at the matrix's
STEPS and validation setting, for every (model, precision) pair of the covering set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py sets it for the suite, before torch loads

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "tests" / "data" / "spread.json"
MARGIN = 5  # measured deviations to bound: for machines whose kernels round elsewhere (docs/testing.md)
FP32_BOUND = 1e-4  # the layout contract (docs/testing.md), not derived
LOW = ("bf16", "fp16")
KEYS = ("loss", "grad_norm", "val")
CASES_ENV = "DLSCALE_SPREAD_CASES"  # the random cases `test_measured_case` runs: a JSON file of Case fields
VALIDATION_KEYS = ("data.limit_eval_tokens=", "data.limit_nsamples_val=")
TOP = 3  # fingerprints kept per case and pass: the largest deviations, with their names


def _sig(x: float) -> float:
    """`x` to 4 significant digits (as check_case reports a deviation)."""
    return float(f"{x:.3e}")


def validation_setting() -> dict[str, list[str]]:
    """Each matrix model's validation overrides (tests/matrix.py MODEL_ARGS): what the val loss is measured on."""
    from tests.matrix import MODEL_ARGS

    return {model: [a for a in args if a.startswith(VALIDATION_KEYS)] for model, args in MODEL_ARGS.items()}


def artefacts(cases: list[dict]) -> dict[str, list[str]]:
    """{model: ["<pass> <name>", ...]}: the fingerprints that part beyond the layout contract in a correct fp32
    layout. Not rounding (fp32 curves agree to about 1e-6): the recorder counts them otherwise in some layouts;
    the fingerprint spread leaves them out (docs/testing.md names them)."""
    found: dict[str, set[str]] = {}
    for case in cases:
        if case["precision"] == "fp32":
            for kind, top in case.get("fingerprints", {}).items():
                found.setdefault(case["model"], set()).update(f"{kind} {name}" for d, name in top if d > FP32_BOUND)
    return {model: sorted(names) for model, names in sorted(found.items()) if names}


def fingerprint_worst(case: dict, skip: list[str]) -> dict[str, float]:
    """{pass: the case's largest fingerprint deviation in it outside `skip`}; where every recorded name of a
    pass's top is skipped, its smallest (the rest lie below it)."""
    worst = {}
    for kind, top in case.get("fingerprints", {}).items():
        kept = [d for d, name in top if f"{kind} {name}" not in skip]
        worst[kind] = kept[0] if kept else top[-1][0] if top else 0.0
    return worst


def derive(cases: list[dict], margin: float) -> dict[str, dict]:
    """What the report derives from its cases: "spread": {model: {precision: {"curves", "worst_case", "cases",
    "fingerprints": {pass: [deviation, case]}}}}, "artefacts" (`artefacts`) and "bounds": {"curves": {model:
    {precision: bound}}, "localiser": {model: {precision: {pass: bound}}}} (see the module docstring)."""
    skipped = artefacts(cases)
    spread: dict[str, dict[str, dict]] = {}
    for case in cases:
        row = spread.setdefault(case["model"], {}).setdefault(case["precision"], {
            "curves": 0.0, "worst_case": "", "cases": 0, "fingerprints": {}})
        row["cases"] += 1
        if case["worst"] >= row["curves"]:
            row["curves"], row["worst_case"] = case["worst"], case["name"]
        for kind, worst in fingerprint_worst(case, skipped.get(case["model"], [])).items():
            if worst >= row["fingerprints"].get(kind, [0.0])[0]:
                row["fingerprints"][kind] = [worst, case["name"]]
        row["fingerprints"] = dict(sorted(row["fingerprints"].items()))
    spread = {m: dict(sorted(rows.items())) for m, rows in sorted(spread.items())}
    bounds: dict[str, dict] = {"curves": {}, "localiser": {}}
    for model, rows in spread.items():
        for precision, row in rows.items():
            low = precision in LOW
            bounds["curves"].setdefault(model, {})[precision] = _sig(margin * row["curves"]) if low else FP32_BOUND
            bounds["localiser"].setdefault(model, {})[precision] = {
                kind: _sig(margin * worst) if low else FP32_BOUND for kind, (worst, _) in row["fingerprints"].items()}
    return {"spread": spread, "artefacts": skipped, "bounds": bounds}


def problems(report: dict) -> list[str]:
    """What makes `report` disagree with itself or with the matrix as it is now (empty when nothing does)."""
    from tests.matrix import covering_set
    from tests.test_matrix import STEPS

    found = []
    derived = derive(report["cases"], report["margin"])
    if {key: report.get(key) for key in derived} != derived:
        found.append("the stored spread, artefacts or bounds are not those derived from the stored cases "
                     "(python -m tests.spread)")
    for i, run in enumerate(report["runs"]):
        if run["steps"] != STEPS:
            found.append(f"run {i} measured {run['steps']} steps per case, the matrix runs {STEPS}")
        if run["validation"] != validation_setting():
            found.append(f"run {i} validated with {run['validation']}, the matrix with {validation_setting()}")
    measured = {(c["model"], c["precision"]) for c in report["cases"]}
    for pair in sorted({(c.model, c.precision) for c in covering_set()[0]} - measured):
        found.append(f"no measured case of {pair[0]} {pair[1]}, a pair of the covering set")
    for model, rows in report["spread"].items():
        if "fp32" in rows and not rows["fp32"]["curves"] * report["margin"] <= FP32_BOUND:
            found.append(f"{model} fp32 spread {rows['fp32']['curves']:.2e} is not {report['margin']}x inside "
                         f"the layout contract {FP32_BOUND:.0e}")
        for kind, (worst, case) in rows.get("fp32", {}).get("fingerprints", {}).items():
            if not worst <= FP32_BOUND:
                found.append(f"{model} fp32 {kind} fingerprint spread {worst:.2e} ({case}) is above the localiser's "
                             f"{FP32_BOUND:.0e}: it would name rounding as a divergence")
    return found


def _machine() -> dict:
    cpu = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"cpu": cpu or platform.processor(), "avx512": sorted(f for f in flags if f.startswith("avx512")),
            "cores": os.cpu_count()}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout


def _run_facts(seed: int) -> dict:
    """The machine, software and tree a run measures (taken as it starts)."""
    import torch

    from tests.test_matrix import STEPS

    dirty = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {**_machine(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "commit": _git("rev-parse", "--short", "HEAD").strip(),
            "modified_files": dirty, "steps": STEPS, "validation": validation_setting(), "seed": seed}


# --- the random cases, through check_case (collected only when this file is named: `tests/spread.py::...`)

from tests.test_matrix import references  # noqa: E402,F401 - the matrix's module fixture, for test_measured_case


def pytest_generate_tests(metafunc):
    if "spread_case" in metafunc.fixturenames:
        from tests.matrix import Case

        path = os.environ.get(CASES_ENV)
        cases = [Case(**fields) for fields in json.loads(Path(path).read_text())] if path else []
        metafunc.parametrize("spread_case", cases, ids=[c.name for c in cases])


def test_measured_case(spread_case, tmp_path, request, references):  # noqa: F811 - the fixture imported above
    """One random accepted case, as the matrix checks a case of its covering set."""
    from tests.test_matrix import check_case

    check_case(spread_case, tmp_path, request, references)


class _Measure:
    """The nested pytest's plugin: fingerprints on, the bound of a pair not measured yet open, the outcomes."""

    def __init__(self, pairs: set[tuple[str, str]]):
        self.pairs, self.outcomes = pairs, {}

    def pytest_collection_finish(self, session):
        import tests.test_matrix as matrix

        if matrix.FINGERPRINTED[0] not in matrix.COMMON:
            matrix.COMMON.extend(matrix.FINGERPRINTED)
        for pair in self.pairs:  # no stored spread yet (a first derivation): measure, do not judge
            if pair[1] in LOW:
                matrix.SPREAD.setdefault(pair, math.inf)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rpartition("[")[2].rstrip("]")
        if report.failed or (report.when == "call" and name not in self.outcomes):
            self.outcomes[name] = report.outcome


def _select(models, precisions, at_least: int, extra: int, seed: int):
    from tests.matrix import random_cases
    from tests.test_matrix import ACCEPTED

    def chosen(c):
        return c.model in models and c.precision in precisions

    covering = [c for c in ACCEPTED if chosen(c)]
    counts: dict[tuple[str, str], int] = {}
    for c in covering:
        counts[(c.model, c.precision)] = counts.get((c.model, c.precision), 0) + 1
    names, drawn = {c.name for c in covering}, []
    pool = [c for c in random_cases(seed, 10**9) if chosen(c) and c.name not in names]
    for c in pool:  # the thin pairs first
        if counts.get((c.model, c.precision), 0) < at_least:
            drawn.append(c)
            counts[(c.model, c.precision)] = counts.get((c.model, c.precision), 0) + 1
    taken = {c.name for c in drawn}
    drawn += [c for c in pool if c.name not in taken][:extra]
    return covering, drawn


def _measure_case(case, source: str, tmp: Path, hook: dict[str, float], outcome: str) -> dict:
    """The report's entry of one case run under `tmp` (the nested pytest's basetemp)."""
    from tests.test_matrix import summary, worst_deviation
    from utils.compare.diverge import check_comparable, deviation, load, pass_values, scan, scan_order

    runs = [d for d in tmp.glob(f"*/{case.name}") if d.is_dir()]
    key = f"{case.model}-{case.precision}-{case.grad_accum_steps}-{case.packing}-False"
    refs = [d for d in tmp.glob(f"matrix_ref*/{key}") if d.is_dir()]
    entry = {"name": case.name, "model": case.model, "precision": case.precision, "source": source,
             "outcome": outcome}
    if not runs or not refs:
        return {**entry, "missing": "the run or its single-process run left no directory"}
    got, reference = summary(runs[0]), summary(refs[0])
    for key in KEYS:  # worst_deviation over one logged value
        only = {k: (got[k] if k == key else []) for k in KEYS}
        entry[key] = _sig(worst_deviation({k: (reference[k] if k == key else []) for k in KEYS}, only))
    entry["worst"] = _sig(worst_deviation(reference, got))
    if case.name in hook and abs(hook[case.name] - entry["worst"]) > 1e-3 * entry["worst"]:
        raise RuntimeError(f"{case.name}: check_case reported {hook[case.name]:.3e}, the run dirs give "
                           f"{entry['worst']:.3e}")
    if (runs[0] / "fingerprints.json").is_file() and (refs[0] / "fingerprints.json").is_file():
        fa, fb = load(refs[0]), load(runs[0])
        steps, order, worst = check_comparable(fa, fb), scan_order(fa, fb), {}
        for step in steps:
            for kind, names in order.items():
                a, b = pass_values(fa, step, kind), pass_values(fb, step, kind)
                for name in (n for n in names if n in a or n in b):
                    d = deviation(a[name], b[name]) if name in a and name in b else math.inf
                    worst.setdefault(kind, {})[name] = max(d, worst.get(kind, {}).get(name, 0.0))
        # each pass's TOP largest, with where (`artefacts` needs more than the largest)
        entry["fingerprints"] = {kind: [[_sig(d), n] for d, n in sorted(((d, n) for n, d in by.items()),
                                                                         reverse=True)[:TOP]]
                                 for kind, by in worst.items()}
        if findings := scan(fa, fb, math.inf)[-1][2]:  # a replica that parts, or a name one run lacks: a defect
            entry["fingerprint_findings"] = findings[0].where()
    return entry


def dumps(report: dict) -> str:
    """The report as JSON, a case to a line."""
    head = json.dumps({k: v for k, v in report.items() if k != "cases"}, indent=1)
    cases = ",\n".join("  " + json.dumps(case) for case in report["cases"])
    return f'{head[:-2]},\n "cases": [\n{cases}\n ]\n}}\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.spread", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["vit", "gpt", "llama"], choices=["vit", "gpt", "llama"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", *LOW], choices=["fp32", *LOW])
    parser.add_argument("--at-least", type=int, default=10, metavar="K",
                        help="random cases until each (model, precision) has K measured (default 10)")
    parser.add_argument("--random", type=int, default=0, metavar="N", help="N more random cases (default 0)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random cases (default 0)")
    parser.add_argument("--margin", type=float, default=MARGIN, help=f"bound / spread (default {MARGIN})")
    parser.add_argument("--out", type=Path, default=REPORT, help=f"the report (default {REPORT.relative_to(ROOT)})")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="run under DIR and keep it (default: a temp dir)")
    parser.add_argument("--reuse", action="store_true", help="with --keep: derive from the runs kept in DIR")
    args = parser.parse_args(argv)

    covering, drawn = _select(set(args.models), set(args.precisions), args.at_least, args.random, args.seed)
    pairs = {(c.model, c.precision) for c in covering + drawn}
    print(f"{len(covering)} covering cases and {len(drawn)} random ones (seed {args.seed}), {len(pairs)} pairs",
          flush=True)
    work = Path(args.keep or tempfile.mkdtemp(prefix="spread-"))
    work.mkdir(parents=True, exist_ok=True)
    hook_file, cases_file, tmp = work / "report.txt", work / "random_cases.json", work / "pytest"
    if not args.reuse:
        hook_file.write_text("")
        cases_file.write_text(json.dumps([dataclasses.asdict(c) for c in drawn]))
        os.environ["DLSCALE_MATRIX_REPORT"], os.environ[CASES_ENV] = str(hook_file), str(cases_file)
        test = "tests/test_matrix.py::test_accepted_combination_follows_the_single_process_run"
        nodes = [f"{test}[{c.name}]" for c in covering] + (["tests/spread.py::test_measured_case"] if drawn else [])
        plugin, facts = _Measure(pairs), _run_facts(args.seed)
        start = time.monotonic()
        os.chdir(ROOT)
        exit_code = int(pytest.main([*nodes, "-n", "0", "-p", "no:cacheprovider", f"--basetemp={tmp}", "-q",
                                     "-o", "console_output_style=count"], plugins=[plugin]))
        facts |= {"runtime_s": round(time.monotonic() - start), "pytest_exit": exit_code}
        (work / "outcomes.json").write_text(json.dumps({"outcomes": plugin.outcomes, "facts": facts}))
    saved = json.loads((work / "outcomes.json").read_text())
    outcomes, facts = saved["outcomes"], saved["facts"]
    hook = {}
    for line in hook_file.read_text().splitlines():  # check_case's lines; the attention check writes its own
        fields = line.split()
        if len(fields) == 3 and fields[1] in ("fp32", *LOW):
            hook[fields[0]] = float(fields[2])
    cases = [_measure_case(c, source, tmp, hook, outcomes.get(c.name, "not run"))
             for source, group in (("covering", covering), ("random", drawn)) for c in group]
    broken = [c for c in cases if "missing" in c or c["outcome"] != "passed" or c.get("fingerprint_findings")]
    for c in broken:
        print(f"not a clean measurement: {c['name']}: {c.get('missing') or c['outcome']} "
              f"{c.get('fingerprint_findings', '')}", file=sys.stderr)
    cases = [c for c in cases if "missing" not in c]

    old = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": [], "cases": []}
    kept = [c for c in old["cases"] if not (c["model"] in args.models and c["precision"] in args.precisions)]
    runs_kept = sorted({c["run"] for c in kept})
    renumber = {old_index: new for new, old_index in enumerate(runs_kept)}
    runs = [old["runs"][i] for i in runs_kept] + [facts]
    cases = [{**c, "run": renumber[c["run"]]} for c in kept] + [{**c, "run": len(runs) - 1} for c in cases]
    cases.sort(key=lambda c: (c["model"], c["precision"], c["source"], c["name"]))
    derived = derive(cases, args.margin)
    spread, bounds = derived["spread"], derived["bounds"]
    report = {"about": "python -m tests.spread (tests/spread.py): the spread of correct layouts of the combination "
                       "matrix and the bounds derived from it; docs/testing.md 'Tolerances'",
              "margin": args.margin, "fp32_bound": FP32_BOUND, "runs": runs, **derived, "cases": cases}
    args.out.write_text(dumps(report))
    print(f"{len(cases)} cases, {facts['runtime_s'] / 60:.1f} minutes of pytest; wrote {args.out}")
    print(f"{'model':6} {'prec':5} {'cases':>5} {'spread':>9} {'bound':>9} {'ratio':>6}  fingerprints: spread, bound")
    for model, rows in spread.items():
        for precision, row in rows.items():
            bound = bounds["curves"][model][precision]
            ratio = bound / row["curves"] if row["curves"] else math.inf
            local = bounds["localiser"][model][precision]
            passes = "  ".join(f"{kind} {worst:.1e}, {local[kind]:.1e}"
                               for kind, (worst, _) in row["fingerprints"].items())
            print(f"{model:6} {precision:5} {row['cases']:5d} {row['curves']:9.2e} {bound:9.1e} {ratio:6.1f}  {passes}")
    for model, names in derived["artefacts"].items():
        print(f"{model}: fingerprints beyond the contract in fp32 (left out of the spread): {', '.join(names)}")
    if found := problems(report):
        print("\n".join(found), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if broken or found else 0


if __name__ == "__main__":
    sys.exit(main())
