"""The combination matrix: every pair of settings the config accepts together trains the single-process model.

tests/matrix.py enumerates the space (model x tp x cp x pp x dp up to 4 ranks x order x dp_mode x
precision x schedule x cp_attention x sequence parallelism x activation checkpointing x accumulation) and
picks an all-pairs covering set. Each accepted case runs STEPS steps through the real entry point
(`train.main` on pooled torchrun-style ranks, tests/rank_pool.py) and must follow the single-process run of
the same model, precision and accumulation: the loss and gradient norm of every step and the final
validation loss within `tolerance(model, precision)`, and its final checkpoint must hold the single-process
model's keys and global shapes (a checkpoint describes the model, not the layout); a case with cp > 1 under bf16
or fp16 also checks the accuracy of its attention as built (tests/attention_accuracy.py: the curves cannot
see the ring's statistics computed in bf16). Each refused case must exit 2 on every rank with the one line
the trainer's checks predict, and nothing else.

Tolerances (relative, per logged value). fp32: 1e-4, the project's layout contract (correct layouts measured far
inside it). bf16 and fp16: derived from the spread among correct layouts of the same model and precision, SPREAD
(each one's worst relative deviation from the single-process run, the largest over every correct layout measured:
the covering set and seeded random cases of the whole space), times MARGIN for machines whose kernels round
elsewhere; both read from tests/data/spread.json, which `python -m tests.spread` measures through `check_case` and
derives (tests/test_spread.py checks it agrees with itself and with STEPS). The spread depends on the model as much
as on the dtype (the ViT's regression moves far less than a language model's cross-entropy), so the bound is per
(model, precision): a bf16 master weight under FSDP (a plant: tests/planted_bugs.py) moved the ViT's curves by
5.1e-4 in 4 steps, 14x its spread then and 60x below the former bound of 8 bf16 unit roundoffs (3.1e-2), which let
it through. `DLSCALE_MATRIX_REPORT=FILE` appends each case's worst deviation to FILE; docs/testing.md has the table
and how to re-derive it.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from tests.attention_accuracy import check_rank
from tests.helpers import QUIET, read_scalars, run_ranks
from tests.matrix import MODEL_ARGS, Case, Mismatch, covering_set, packing_args, random_cases
from tests.rank_pool import run_entry_ranks
from utils.cli.config import load_config

STEPS = 3  # 16 of 16 plants killed at 3 as at 4 (docs/testing.md); a step is a seventh of the matrix's CPU
COMMON = [*QUIET, f"trainer.max_steps={STEPS}", "trainer.log_every=1"]
# A failing case runs again, and its single-process run too, with fingerprints of every step
# (utils/engine/fingerprints.py): its message names where the two part (utils/compare/diverge.py), and so does
# each planted bug's report. The runs are deterministic, so the second pair parts as the first did; a passing
# case does not pay for the fingerprints (about 6% of a case's CPU).
FINGERPRINTED = [f"trainer.fingerprint_steps={STEPS}"]
# The largest relative deviation of a correct layout from the single-process run, per (model, precision), and the
# bound's factor over it: measured and derived by `python -m tests.spread` into tests/data/spread.json (its cases,
# machine, torch, date, commit; docs/testing.md has the table); tests/test_spread.py checks that the stored bounds
# are those of the stored cases, at STEPS and the matrix's validation setting, for every pair of the covering set.
SPREAD_REPORT = Path(__file__).resolve().parent / "data" / "spread.json"
_SPREAD = json.loads(SPREAD_REPORT.read_text()) if SPREAD_REPORT.is_file() else {"spread": {}, "margin": 5}
SPREAD = {(model, precision): row["curves"] for model, rows in _SPREAD["spread"].items()
          for precision, row in rows.items() if precision != "fp32"}
MARGIN = _SPREAD["margin"]


def tolerance(model: str, precision: str) -> float:
    """The relative bound of a logged value of `model` under `precision` (see the module docstring)."""
    if precision == "fp32":
        return 1e-4
    if (model, precision) not in SPREAD:
        raise KeyError(f"no measured spread of {model} {precision} in {SPREAD_REPORT}: python -m tests.spread")
    return MARGIN * SPREAD[(model, precision)]


ACCEPTED, REFUSED = covering_set()


KIND_FIXTURES = {"era5": "era5_root", "wikitext": "corpus_root"}  # each task's data (the task's DATA_KIND)


def _root_fixture(model: str) -> str:
    from utils.tasks import task_of
    from utils.tasks.registry import spec_of

    return KIND_FIXTURES[task_of(spec_of(model)).DATA_KIND]


def _roots(request) -> dict[str, str]:
    return {model: str(request.getfixturevalue(_root_fixture(model))) for model in MODEL_ARGS}


def case_argv(run_dir: Path, model: str, root: str, overrides: list[str]) -> list[str]:
    return [*MODEL_ARGS[model], f"data.root={root}", *COMMON, f"run.dir={run_dir}", *overrides]


def run_case(tmp: Path, name: str, model: str, root: str, overrides: list[str], world: int):
    """All ranks' results of one run through the entry point, and its run directory."""
    run_dir = tmp / name
    return run_entry_ranks(case_argv(run_dir, model, root, overrides), world), run_dir


class Broken(Exception):
    """A run the comparison needs did not finish as a run can be compared: a crash, an exit 2 where no refusal is
    predicted (a torch error re-raised as a ConfigError, the NaN stop, a build-time check), or a failed
    single-process reference. Never a kill (tests/planted_bugs.py counts Mismatch only)."""


def assert_exit(results, code: int) -> None:
    """Every rank exits `code`. Only a refused case that trained (0 on every rank where 2 is predicted) is a
    Mismatch here; anything else other than predicted is Broken: an exit 2 of an accepted case is no verdict on its
    layout (the refusal lines are compared by the refused cases' own test)."""
    codes = [r.value for r in results]
    if codes != [code] * len(results):
        first = next((r for r in results if r.value != code), results[0])
        detail = first.error or (first.stdout[-3000:] + first.stderr[-3000:])
        kind = Mismatch if code == 2 and set(codes) == {0} else Broken
        raise kind(f"exit codes {codes}, expected {code}:\n{detail}")


def summary(run_dir: Path) -> dict:
    """The logged curves and the final checkpoint's model and optimizer keys with their global shapes."""
    from utils.checkpoints.sharded_state import read_shapes

    scalars = read_scalars(run_dir)
    shapes = read_shapes(run_dir / "checkpoints" / f"step_{STEPS:07d}")
    return {"loss": [v for _, v in scalars["train/loss"]], "grad_norm": [v for _, v in scalars["train/grad_norm"]],
            "val": [v for _, v in scalars["val/loss"]],
            "shapes": {k: tuple(v) for k, v in shapes.items() if k.startswith(("model/", "optim/"))}}


@pytest.fixture(scope="module")
def references(tmp_path_factory, request):
    """The single-process run of (model, precision, accumulation, packing), made on first use (`fingerprinted`:
    with FINGERPRINTED, for a failing case's localisation)."""
    made: dict[tuple, dict] = {}
    tmp = tmp_path_factory.mktemp("matrix_ref")
    roots = _roots(request)

    def get(case: Case, fingerprinted: bool = False) -> dict:
        key = (case.model, case.precision, case.grad_accum_steps, case.packing, fingerprinted)
        if key not in made:
            name = "-".join(map(str, key))
            results, run_dir = run_case(tmp, name, case.model, roots[case.model],
                                        [f"precision={case.precision}", f"trainer.grad_accum_steps={key[2]}",
                                         *packing_args(case.packing), *(FINGERPRINTED if fingerprinted else [])],
                                        1)
            try:
                assert_exit(results, 0)
            except Broken as err:  # never a kill: a failed reference says nothing of the layout
                raise Broken(f"the single-process reference failed: {err}") from None
            made[key] = {**summary(run_dir), "dir": run_dir}
        return made[key]

    return get


def worst_deviation(reference: dict, got: dict) -> float:
    """The largest relative difference of a logged value from the single-process run's."""
    pairs = [(r, g) for key in ("loss", "grad_norm", "val") for r, g in zip(reference[key], got[key])]
    return max(abs(g - r) / abs(r) for r, g in pairs)


def assert_follows(reference: dict, got: dict, model: str, precision: str) -> None:
    """The case's curves and checkpoint against the single-process run's; a Mismatch names the first value off,
    its margin is the worst value's (how many times the bound it is off)."""
    bound = tolerance(model, precision)
    for key in ("loss", "grad_norm", "val"):
        if len(got[key]) != len(reference[key]):
            raise Mismatch(f"{key}: {len(got[key])} values logged, the single-process run logged {len(reference[key])}")
        for i, (r, g) in enumerate(zip(reference[key], got[key])):
            if not abs(g - r) <= bound * abs(r):  # a NaN fails too
                worst = worst_deviation(reference, got)
                raise Mismatch(f"{key}[{i}] = {g:.6g}, single process {r:.6g}: relative {abs(g - r) / abs(r):.2e} "
                               f"> {bound:.1e} ({model}, {precision})",
                               margin=worst / bound if worst == worst else math.inf)  # NaN: no margin to speak of
    if got["shapes"] != reference["shapes"]:
        raise Mismatch("the checkpoint does not describe the single-process model: "
                       f"{sorted(set(got['shapes'].items()) ^ set(reference['shapes'].items()))[:4]}")


def where_it_parts(case: Case, tmp_path: Path, root: str, references) -> tuple[str, float]:
    """The case and its single-process run again with fingerprints (FINGERPRINTED): the first step, module and
    pass where they part (utils/compare/diverge.py), and how many times the localiser's tolerance the worst
    parameter or module of that pass is off (0 where none parts)."""
    from utils.compare import diverge

    results, run_dir = run_case(tmp_path, f"{case.name}-fingerprinted", case.model, root,
                                [*case.overrides(), *FINGERPRINTED], case.world)
    assert_exit(results, 0)
    reference = references(case, fingerprinted=True)
    where = diverge.first_divergence(reference["dir"], run_dir)
    if where is None:
        return "no parameter's gradient or update parts", 0.0
    a, b = diverge.load(reference["dir"]), diverge.load(run_dir)
    limits = diverge.tolerances(a, b, None)  # per pass, derived like the curves' (tests/data/spread.json)
    _, kind, _, (worst, name) = diverge.scan(a, b, limits)[-1]
    return f"{where} ({name} {worst / limits[kind]:.3g}x the localiser's {limits[kind]:.1e})", worst / limits[kind]


def attention_verdict(err: RuntimeError) -> Exception:
    """A rank's failure in the attention check as the matrix counts it: the check's own verdict
    (tests/attention_accuracy.py `AttentionLessAccurate`: "dV 1.9e-02 > 1.25 x 5.2e-03", its margin the worst such
    ratio) is a Mismatch; any other error, an internal assert of the code under test included, stays a crash."""
    if "AttentionLessAccurate: " not in str(err):
        return err
    last = str(err).strip().splitlines()[-1]
    ratios = [float(g) / (float(s) * float(b)) for g, s, b in re.findall(r"(\S+) > (\S+) x (\S+?)(?:,|$)", last)]
    return Mismatch(f"the attention check: {last}", max(ratios, default=math.inf))


def require_margin(err: Mismatch) -> None:
    """Raise the Mismatch; a planted run (tests/planted_bugs.py sets DLSCALE_KILL_MARGIN) that is off by less than
    that many times its bound is skipped as thin instead, so that the plant's next case runs (a kill needs margin)."""
    needed = float(os.environ.get("DLSCALE_KILL_MARGIN", "1"))
    if err.margin < needed:
        pytest.skip(f"thin: {str(err).splitlines()[0]}")
    raise err


def check_case(case: Case, tmp_path: Path, request, references) -> None:
    root = _roots(request)[case.model]
    results, run_dir = run_case(tmp_path, case.name, case.model, root, case.overrides(), case.world)
    assert_exit(results, 0)
    reference, got = references(case), summary(run_dir)
    if report := os.environ.get("DLSCALE_MATRIX_REPORT"):  # the deviations docs/testing.md states
        with open(report, "a") as out:
            out.write(f"{case.name} {case.precision} {worst_deviation(reference, got):.3e}\n")
    try:
        assert_follows(reference, got, case.model, case.precision)
    except Mismatch as err:  # where the two runs part, on the message's first line (the plants' reports show it)
        first, _, rest = str(err).partition("\n")
        try:
            where, parameter_margin = where_it_parts(case, tmp_path, root, references)
        except Exception as failed:  # noqa: BLE001 - the comparison's verdict stands without its localisation
            where, parameter_margin = f"? (the localiser failed: {failed})", 0.0
        margin = max(err.margin, parameter_margin)
        require_margin(Mismatch(f"{first}; parts first at {where}; margin {margin:.3g}x\n{rest}".rstrip(), margin))
    if case.cp > 1 and case.precision != "fp32":  # the attention as built for the case (tests/attention_accuracy.py)
        try:
            cfg = load_config(case_argv(run_dir, case.model, root, case.overrides()))[0]
            run_ranks(check_rank, case.world, tmp_path, cfg)
        except RuntimeError as err:
            if (verdict := attention_verdict(err)) is err:
                raise
            require_margin(verdict)


@pytest.mark.slow
@pytest.mark.parametrize("case", ACCEPTED, ids=[c.name for c in ACCEPTED])
def test_accepted_combination_follows_the_single_process_run(case, tmp_path, request, references):
    check_case(case, tmp_path, request, references)


@pytest.mark.slow
@pytest.mark.parametrize("case,why", REFUSED, ids=[c.name for c, _ in REFUSED])
def test_refused_combination_exits_2_with_one_line(case, why, tmp_path, request):
    results, run_dir = run_case(tmp_path, case.name, case.model, _roots(request)[case.model], case.overrides(),
                                case.world)
    assert_exit(results, 2)
    for result in results:  # refused, by the check the prediction names, or by another: not what was predicted
        if result.stderr.strip().splitlines() != [f"error: {why}"]:
            raise Mismatch(f"refused with {result.stderr.strip()[-500:]!r}, predicted 'error: {why}'")
    if (run_dir / "checkpoints").exists():
        raise Mismatch("a refused case wrote a checkpoint")


def test_the_factors_hold_every_value_the_config_accepts():
    """A value the schema accepts and FACTORS lacks would be a combination never tested: the schedules, the cp
    variants, the precisions (tf32 is fp32 on a CPU: torch's TF32 switches act on CUDA matmuls only) and the
    model families (the registry's built-in ones, each with its settings; a family found by DLSCALE_FAMILIES or an
    entry point, as the tests' toy family, is not the tree's: tests/test_toy_family.py runs it)."""
    from tests.matrix import FACTORS
    from utils.schema import CP_VARIANTS, SCHEDULES
    from utils.schema import PRECISION_MODES as MODES
    from utils.tasks.registry import BUILT_IN, MODELS, ORIGINS

    assert set(FACTORS["schedule"]) == set(SCHEDULES)
    assert set(FACTORS["cp_attention"]) == set(CP_VARIANTS)
    assert set(FACTORS["precision"]) == set(MODES) - {"tf32"}
    built_in = {arch for arch in MODELS if ORIGINS[f"model.arch {arch!r}"][0] == "the built-in families"}
    assert set(FACTORS["model"]) == set(BUILT_IN) == built_in == set(MODEL_ARGS)
    assert all(_root_fixture(model) for model in MODEL_ARGS)  # each family's data is one the matrix makes
    from tests.matrix import _derived_args
    from utils.cli.config import load_config

    for arch in BUILT_IN:  # what a new family folder of networks/ would run with, untuned: it composes
        assert load_config(_derived_args(arch))[0].model.arch == arch


@pytest.mark.slow
def test_covering_set_covers_every_accepted_pair():
    """The cached set (tests/data/matrix_cases.json) is the one computed now, and it is all-pairs against a
    brute-force count of the space: every pair of settings of an accepted case is in a chosen case, every
    refused case holds a pair no accepted case has."""
    from tests.matrix import REQUIRED, _pairs, compute_covering_set, holds, refusal, space

    assert (ACCEPTED, REFUSED) == compute_covering_set()
    verdicts = {c: refusal(c) for c in space()}
    needed = {p for c, why in verdicts.items() if why is None for p in _pairs(c)}
    covered = {p for c in ACCEPTED for p in _pairs(c)}
    assert needed == covered and len(ACCEPTED) < len(space()) / 20
    assert all(verdicts[c] is None for c in ACCEPTED)
    assert all(set(_pairs(c)) - needed and verdicts[c] == why for c, why in REFUSED)
    assert all(any(holds(c, spec) for c in ACCEPTED) for spec in REQUIRED)


@pytest.mark.slow
def test_the_predicted_verdicts_are_those_of_the_command_line():
    """`refusal` (a config made by dataclasses.replace, resolve_plan) against the command-line path: the case's
    overrides composed by Hydra (`load_config`), the launch's grid check and the trainer's own pipeline plan, for
    every refused case of the set and 40 seeded cases of the space: the same verdict, the same line."""
    import random

    from tests.matrix import GLOBAL_BATCH, refusal, space
    from utils import ConfigError
    from utils.comm import Axis, batch_parts, check_grid
    from utils.data.batching import check_batch
    from utils.launch_env import LaunchEnv
    from utils.tasks import pipeline_plan

    def command_line(case: Case) -> str | None:
        try:
            cfg = load_config([*MODEL_ARGS[case.model], *case.overrides()])[0]
            sizes = check_grid(cfg.parallel, LaunchEnv(world_size=case.world))
            microbatches = pipeline_plan(cfg).microbatches if sizes[Axis.PP] > 1 else 1
            check_batch(cfg.trainer.global_batch_size, batch_parts(sizes), cfg.trainer.grad_accum_steps,
                        GLOBAL_BATCH, microbatches)
        except ConfigError as err:
            return str(err)
        return None

    cases = [c for c, _ in REFUSED] + random.Random(0).sample(space(), 40)
    assert any(refusal(c) is None for c in cases) and any(refusal(c) for c in cases)
    for case in cases:
        assert command_line(case) == refusal(case), case.name


@pytest.mark.slow
def test_hierarchical_accepted_where_its_groups_fit():
    """parallel.cp_attention=hierarchical is refused for its groups exactly where cp < 4 or cp_a2a does not
    divide cp (in one line); the covering set runs it on every model and checks both refusals."""
    from tests.matrix import refusal, space

    for case in (c for c in space() if c.cp_attention == "hierarchical"):
        fits = case.cp >= 4 and case.cp % case.cp_a2a == 0
        why = refusal(case) or ""  # fsdp with fp16 is refused for its own reason
        assert why.startswith("parallel.cp_attention=hierarchical needs groups of ") != fits, (case.name, why)
    chosen = [c for c in ACCEPTED if c.cp_attention == "hierarchical"]
    assert {c.model for c in chosen} == {"vit", "gpt", "llama"} and all(c.cp == 4 for c in chosen)
    assert {c.cp_a2a for c, _ in REFUSED if c.cp_attention == "hierarchical"} == {2, 3}


def test_random_cases(tmp_path, request, references):
    """`pytest tests/test_matrix.py --matrix-seed S --matrix-cases N -k random`: N seeded random cases of the
    whole accepted space, for longer runs outside the default suite (skipped without --matrix-cases)."""
    count = request.config.getoption("--matrix-cases")
    if not count:
        pytest.skip("random matrix cases run with --matrix-cases N (and --matrix-seed S)")
    failures = []
    for case in random_cases(request.config.getoption("--matrix-seed"), count):
        try:
            check_case(case, tmp_path, request, references)
        except (AssertionError, Broken) as err:
            failures.append(f"{case.name}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)
