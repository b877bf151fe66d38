"""Tensor parallelism against the NERSC tutorial: `python -m utils.bench parallel=tp2 ... --seed-dir DIR`.

Started as one process with a layout of tp > 1 ranks (no torchrun around it), the benchmark times three arms
at the same shape, precision, batch and Adam kernel, each launched by torchrun on this machine with
tp ranks (torchrun gives each rank one thread unless OMP_NUM_THREADS says otherwise):

- the tutorial's model-parallel ViT as its train_mp.py runs it (utils/bench/seed_step.py, tp ranks, DDP);
- this project's train step with sequence parallelism on (`parallel.sequence_parallel=true`, the default with
  GPUs);
- the same with sequence parallelism off (`false`, the default on CPU: distributed/tensor/parallelize.py).

The arms are interleaved: `--rounds` rounds, each running every arm once, so that a machine whose speed drifts
(shared cores) slows every arm alike. Each arm's figure is the median over rounds of its seconds per step
(rank 0's mean over `--steps` timed steps after `--warmup`); the spread is the lowest and highest round, and
each ratio is the arm's median over the seed's. The table goes to stdout; nothing is written elsewhere.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

from utils import require

ARMS = (("seed", "NERSC tutorial ViT (its model-parallel ViT in DDP)"),
        ("sp_on", "this project, sequence parallelism on (the default with GPUs)"),
        ("sp_off", "this project, sequence parallelism off (the default on CPU)"))


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def last_json(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON line rank 0 printed last, or a one-line refusal naming the arm that failed."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    require(proc.returncode == 0 and lines, f"{what} failed (exit {proc.returncode}): {tail}", "--seed-dir",
            "run that arm alone to see its whole output")
    return json.loads(lines[-1])


def arm_command(arm: str, overrides: list[str], seed_dir: Path, spec: dict, tp: int, warmup: int,
                steps: int) -> list[str]:
    if arm == "seed":
        script = Path(__file__).with_name("seed_step.py")
        return torchrun(tp) + [str(script), str(seed_dir), json.dumps({**spec, "tp": tp})]
    sp = "true" if arm == "sp_on" else "false"
    return torchrun(tp) + ["-m", "utils.bench", *overrides, f"parallel.sequence_parallel={sp}",
                           "--warmup", str(warmup), "--steps", str(steps), "--json"]


def compare(overrides: list[str], seed_dir: Path, spec: dict, tp: int, warmup: int, steps: int,
            rounds: int) -> dict[str, list[float]]:
    """Seconds per step of every arm in every round (arms interleaved within each round)."""
    root = Path(__file__).resolve().parents[2]
    seconds: dict[str, list[float]] = {arm: [] for arm, _ in ARMS}
    for _ in range(rounds):
        for arm, name in ARMS:
            proc = subprocess.run(arm_command(arm, overrides, seed_dir, spec, tp, warmup, steps), cwd=root,
                                  capture_output=True, text=True)
            seconds[arm].append(last_json(proc, name)["seconds"])
    return seconds


def table(seconds: dict[str, list[float]], tp: int, device: str, rounds: int, steps: int) -> str:
    """The markdown table: median ms per step, the spread over rounds, and each arm over the seed."""
    seed = statistics.median(seconds["seed"])
    lines = [f"tp={tp} against the NERSC tutorial, {device}, {datetime.date.today()}, {rounds} interleaved "
             f"round(s) x {steps} timed steps",
             "| step | median ms | min-max ms | / seed |", "|---|---|---|---|"]
    for arm, name in ARMS:
        values = seconds[arm]
        mid = statistics.median(values)
        lines.append(f"| {name} | {1e3 * mid:.1f} | {1e3 * min(values):.1f}-{1e3 * max(values):.1f} "
                     f"| {mid / seed:.2f} |")
    return "\n".join(lines)
