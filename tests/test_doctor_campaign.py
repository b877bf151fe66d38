"""The GPU campaign (`python -m utils.doctor --campaign`, docs/gpu_campaign.md): its plan, its limits, its dry run.

On a GPU node the campaign runs the `pytest -m gpu` tier, the doctor and utils.bench within 10 minutes; here its
plan is checked for 1 and 2 GPUs, a step that outlives its limit or the budget is recorded as such, bad input is
one line and exit 2, and the dry run (`--dry-run`: every step at tiny sizes on the CPU, the compiled benchmarks
listed) runs whole through the real command and writes its report.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from utils import ConfigError
from utils.doctor import campaign
from utils.doctor.run import main


def test_the_plan_on_one_and_two_gpus(tmp_path):
    one = campaign.plan(False, 1, tmp_path)
    names = [s.name for s in one]
    assert names == ["pytest -m gpu", "doctor single device", "bench vit_base bf16", "bench vit_base bf16 compile",
                     "bench gpt_small bf16", "bench gpt_small bf16 compile"]
    assert all(s.run for s in one) and sum(s.timeout_s for s in one) > campaign.BUDGET_S  # the budget caps them
    assert "precision.compile=true" in one[3].argv and "precision=bf16" in one[5].argv
    assert any("test_gpu_blocks.py" in a for a in one[0].argv) and ["-m", "gpu"] == one[0].argv[2:4]
    two = campaign.plan(False, 2, tmp_path, seed_dir=tmp_path / "seed")
    assert "parallel.tp=2" in two[1].argv and two[1].name == "doctor tp2"
    assert [("--seed-dir" in s.argv) for s in two[2:]] == [True, True, False, False]  # the tutorial has a ViT only
    dry = campaign.plan(True, 0, tmp_path)
    assert [s.run for s in dry] == [True, True, True, False, True, False] and "model=vit_tiny" in dry[1].argv


def test_a_step_past_its_limit_or_the_budget(tmp_path):
    sleep = campaign.Step("sleep", ["-c", "import time; print('started', flush=True); time.sleep(30)"], 2)
    record = campaign.run_step(sleep, tmp_path, time.monotonic() + 60)
    assert record["status"].startswith("timeout") and record["seconds"] < 20
    late = campaign.run_step(sleep, tmp_path, time.monotonic() + 5)
    assert late["status"] == "listed" and "budget" in late["why"]
    failing = campaign.run_step(campaign.Step("exit 3", ["-c", "raise SystemExit(3)"], 30), tmp_path,
                                time.monotonic() + 60)
    assert failing["status"] == "fail (exit 3)"


def test_bench_rows_are_read_by_their_header():
    text = ("| date | device | model | samples/s | MFU |\n|---|---|---|---|---|\n| 2026-11-27 | NVIDIA H100 | vit_base "
            "| 41.2 | 45.1% |\nnoise\n")
    assert campaign.table_rows(text) == [{"date": "2026-11-27", "device": "NVIDIA H100", "model": "vit_base",
                                          "samples/s": "41.2", "MFU": "45.1%"}]


@pytest.mark.parametrize("argv, setting", [(["--campaign", "--bogus"], "--bogus"),
                                           (["--campaign", "--budget-s", "soon"], "--budget-s"),
                                           (["--campaign"], "--campaign")])  # no GPU here, and no --dry-run
def test_bad_campaign_input_is_one_line(argv, setting, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and f"({setting})" in err, err
    with pytest.raises(ConfigError):
        campaign.parse(["--seed-dir", "/nonexistent"])


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path, capsys):
    assert main(["--campaign", "--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "campaign.json").read_text())
    assert report["kind"] == "dlscale-gpu-campaign" and report["dry_run"] and report["seconds"] < 600
    assert report["environment"]["torch"]
    assert report["environment"]["python"] == ".".join(map(str, sys.version_info[:3]))
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    assert statuses == {"pytest -m gpu": "pass", "doctor single device": "pass", "bench vit_tiny bf16": "pass",
                        "bench vit_tiny bf16 compile": "listed", "bench gpt_tiny bf16": "pass",
                        "bench gpt_tiny bf16 compile": "listed"}, report["steps"]
    doctor = report["steps"][1]["figures"]
    assert doctor["fail"] == 0 and doctor["pass"] > 0
    rows = [r for s in report["steps"] for r in s.get("figures", {}).get("rows", [])]
    assert [r["model"] for r in rows] == ["vit_tiny", "gpt_tiny"] and all(float(r["samples/s"]) > 0 for r in rows)
    text = (tmp_path / "campaign.md").read_text()
    assert "(dry run)" in text and f"torch {report['environment']['torch']}" in text
