"""The doctor (`python -m utils.doctor`, utils/doctor/) on gloo ranks: its report, its bandwidth file, and planted
faults that must fail it.

The healthy run goes through the command line and the doctor's own launcher (forked CPU ranks), like a user's
first run; the planted faults run the doctor's rank command on pooled ranks (tests/rank_pool.py) with one
defect patched into that process and undone after: a mapping whose backward drops the sum over ranks
(mappings class, exit bit 16) and a row-parallel linear that adds its bias before the reduction (layers class,
exit bit 32), and DDP summing the gradients over dp instead of averaging them (layout class, exit bit 64: Adam
hardly notices a gradient's scale, the curve's gradient norms do).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
from tests.rank_pool import pool
from utils.doctor.bandwidth import OPS, bandwidth_checks, bus_factor, link_gbs
from utils.doctor.report import EXIT_BITS, KINDS, Check, exit_status, failed_kinds

TINY = ["model.depth=1", "model.embed_dim=32", "model.num_heads=4", "trainer.global_batch_size=4",
        "--steps", "2", "--timed-steps", "1", "--iters", "1", "--sizes-mib", "0.0625"]


@pytest.mark.slow
def test_a_healthy_layout_passes_with_a_report_and_a_bandwidth_file(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "utils.doctor", "parallel=tp2", *TINY, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launching 2 ranks on CPU (gloo)" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "dlscale-doctor" and report["exit_status"] == 0 and report["world"] == 2
    checks = report["checks"]
    assert {c["kind"] for c in checks} == set(KINDS)
    assert all(c["status"] in ("pass", "warn") for c in checks)
    names = [c["name"] for c in checks if c["kind"] == "mappings"]
    assert len(names) == 18 and "all_gather_linear on tp (2 ranks), bfloat16" in names  # 9 mappings x 2 dtypes
    curve = next(c for c in checks if c["name"].startswith("tp2 vs single device"))
    assert curve["status"] == "pass" and len(curve["figures"]["layout"]["grad_norm"]) == 2
    markdown = (out / "report.md").read_text()
    assert len([line for line in markdown.splitlines() if line.startswith("| ")]) == len(checks) + 1  # + header
    assert "0 failed: exit status 0" in markdown
    check_bandwidth_file(json.loads((out / "bandwidths.json").read_text()))


def check_bandwidth_file(data: dict) -> None:
    """The exact format the planner reads (`--bandwidths FILE`)."""
    assert set(data) == {"kind", "version", "date", "device", "backend", "world", "intra_gbs", "inter_gbs", "groups"}
    assert (data["kind"], data["version"], data["device"], data["backend"], data["world"]) == \
        ("dlscale-bandwidths", 1, "cpu", "gloo", 2)
    assert len(data["date"]) == 10 and data["inter_gbs"] is None  # ISO date; no group spans nodes
    assert set(data["groups"]) == {"tp"}
    tp = data["groups"]["tp"]
    assert tp["size"] == 2 and tp["spans_nodes"] is False
    assert set(tp["busbw_gbs"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert all(isinstance(v, float) and v > 0 for v in tp["busbw_gbs"].values())
    assert data["intra_gbs"] == statistics.median([tp["busbw_gbs"]["all_gather"], tp["busbw_gbs"]["reduce_scatter"]])


def _gather_without_sum(x, axis, dim, sizes=None):
    """The defect: all_gather_region built on gather_from_region's Function, whose backward keeps this rank's
    chunk of the gradient instead of reduce-scattering it (the partial gradients are never summed)."""
    from distributed.mappings import _GatherFromRegion, _resolve_sizes

    return _GatherFromRegion.apply(x, axis, dim, _resolve_sizes(x, axis, dim, sizes))


def _row_bias_on_every_rank(forward):
    """The defect: RowParallelLinear's bias added on every rank before the reduction (summed t times)."""
    return lambda self, x: forward(self, x) + (self.axis.size - 1) * self.bias


def _ddp_sums(hook):
    """The defect: DDP's gradient hook sums the gradients over dp instead of averaging them."""
    return lambda state, bucket: hook((state[0], 1), bucket)


def _doctor_rank(rank: int, world: int, argv: list[str], fault: str) -> int:
    """The doctor's rank command with `fault` planted in this pooled process (and removed after)."""
    from distributed import data_parallel, mappings
    from distributed.tensor.layers import RowParallelLinear
    from utils.doctor.run import rank_command

    target, name, defect = {
        "mapping": (mappings, "all_gather_region", _gather_without_sum),
        "layer": (RowParallelLinear, "forward", _row_bias_on_every_rank(RowParallelLinear.forward)),
        "ddp_sums": (data_parallel, "_allreduce_mean_hook", _ddp_sums(data_parallel._allreduce_mean_hook))}[fault]
    original = vars(target)[name]
    setattr(target, name, defect)
    try:
        return rank_command(list(argv))
    except SystemExit as exit_:
        return exit_.code
    finally:
        setattr(target, name, original)


@pytest.mark.parametrize("fault, layout, world, kind, failing", [
    ("mapping", "parallel.tp=2", 2, "mappings", "all_gather_region on tp (2 ranks)"),
    ("layer", "parallel.tp=4", 4, "layers", "RowParallelLinear (SP off) on tp (4 ranks)"),
    ("ddp_sums", "parallel.dp=2", 2, "layout", "dp2 vs single device")])
@pytest.mark.slow
def test_a_planted_fault_fails_the_doctor(fault, layout, world, kind, failing, tmp_path):
    others = ",".join(k for k in ("mappings", "layers", "layout") if k != kind)  # one class per case: cheaper
    argv = [layout, *TINY, "--skip", f"bandwidth,{others}", "--out", str(tmp_path)]
    results = pool().run(_doctor_rank, world, argv, fault, timeout_s=120)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert results[0].value == EXIT_BITS[kind], (results[0].value, results[0].stdout[-3000:])
    assert [r.value for r in results[1:]] == [0] * (world - 1)
    checks = json.loads((tmp_path / "report.json").read_text())["checks"]
    failed = {c["name"] for c in checks if c["status"] == "fail"}
    assert any(name.startswith(failing) for name in failed), failed
    assert {c["kind"] for c in checks if c["status"] == "fail"} == {kind}
    assert not (tmp_path / "bandwidths.json").exists()  # skipped: no file claims figures it did not measure


def _group(busbw: float, spans: bool, ok: bool = True) -> dict:
    """An axis as `bandwidth.measure` returns it: two sizes, every op at `busbw` GB/s at the largest."""
    row = {op: {"algbw_gbs": busbw, "busbw_gbs": busbw, "ok": ok} for op in OPS}
    small = {op: dict(fig, busbw_gbs=busbw / 10) for op, fig in row.items()}
    return {"size": 2, "spans_nodes": spans, "sizes": {1024: small, 4096: row}}


def test_bandwidth_verdicts_and_the_planner_figures():
    """Against the planner's cpu preset (5 GB/s): pass at 0.8 of it (ACHIEVABLE_FRACTION), warn below, fail below
    the fraction or on a wrong value; intra/inter are medians over the axes inside one node / spanning nodes, at the
    largest size."""
    cpu = torch.device("cpu")
    statuses = {name: [c.status for c in bandwidth_checks({"tp": group}, cpu, 0.25)] for name, group in
                {"fast": _group(6.0, False), "slow": _group(2.0, False), "broken": _group(1.0, False),
                 "wrong": _group(6.0, False, ok=False)}.items()}
    assert statuses == {"fast": ["pass", "pass"], "slow": ["pass", "warn"], "broken": ["pass", "fail"],
                        "wrong": ["fail", "pass"]}
    assert exit_status(bandwidth_checks({"tp": _group(1.0, False)}, cpu, 0.25)) == EXIT_BITS["bandwidth"] == 8
    groups = {"tp": _group(4.0, False), "cp": _group(2.0, False), "dp": _group(0.5, True)}
    assert (link_gbs(groups, False), link_gbs(groups, True), link_gbs({}, True)) == (3.0, 0.5, None)
    assert [bus_factor(op, 4) for op in OPS] == [1.5, 0.75, 0.75, 0.75, 1.0]  # nccl-tests' factors


def test_the_exit_status_names_the_failing_classes():
    checks = [Check("layers", "a", "fail"), Check("mappings", "b", "fail"), Check("layers", "c", "fail"),
              Check("bandwidth", "d", "warn")]
    assert exit_status(checks) == 48 and failed_kinds(48) == ["mappings", "layers"]
    assert exit_status([Check("environment", "e", "warn")]) == 0
    assert sorted(EXIT_BITS.values()) == [4, 8, 16, 32, 64]  # never 1 (crash), 2 (bad input) or 75 (stopped)


def test_bad_options_are_refused_before_any_work(tmp_path):
    from tests.helpers import run_main

    code, _, err = run_main("utils.doctor.run", "--steps", "0", "--out", str(tmp_path))
    assert code == 2 and err.startswith("error: bad --steps value '0' (--steps)")
    code, _, err = run_main("utils.doctor.run", "--skip", "environment")
    assert code == 2 and "(--skip)" in err
    assert not any(tmp_path.iterdir())


def test_the_slurm_script_checks_one_node_and_refuses_more():
    """submit/doctor.sh runs the doctor as one task on one node; a job of two nodes is refused in one line."""
    env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}
    proc = subprocess.run(["bash", str(ROOT / "submit" / "doctor.sh"), "parallel=tp2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: submit/doctor.sh checks one node, the job has 2 (--nodes)")
    assert len(proc.stderr.strip().splitlines()) == 1
    text = (ROOT / "submit" / "doctor.sh").read_text()
    assert "python -m utils.doctor \"$@\"" in text and "#SBATCH --nodes=1" in text
    assert "#SBATCH --ntasks-per-node=1" in text
