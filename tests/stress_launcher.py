"""Stress run for the multi-rank launcher with data workers (issue: heap corruption seen once in ~16
runs of `train_mp.py parallel=tp2 trainer.max_steps=30`). Not part of the suite (minutes of CPU).

    python tests/stress_launcher.py --runs 20 [--out DIR] [extra overrides ...]

Runs the launcher `--runs` times with data workers (validation and checkpoints included) and reports
every run that did not exit 0, with the lines of its output that name a crash (malloc, Segmentation,
core dumped, signal). Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRASH = re.compile(r"malloc|corrupt|Segmentation|core dumped|double free|Aborted|signal|died", re.I)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="run folders go here (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="extra train_mp.py overrides")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="stress_"))
    failures = 0
    for i in range(args.runs):
        cmd = [sys.executable, str(ROOT / "train_mp.py"), "parallel=tp2", "trainer.max_steps=30",
               "trainer.val_every=10", "trainer.ckpt_every=10", "trainer.num_workers=2",
               f"run.dir={out / f'run{i:03d}'}", *args.overrides]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        crash = [line for line in (proc.stdout + proc.stderr).splitlines() if CRASH.search(line)]
        failures += proc.returncode != 0
        print(f"run {i + 1}/{args.runs}: exit {proc.returncode} in {time.time() - t0:.1f} s"
              + ("" if proc.returncode == 0 else "\n  " + "\n  ".join(crash[-8:] or proc.stderr.splitlines()[-8:])),
              flush=True)
    print(f"{failures} of {args.runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
