"""`python -m utils.bench --seed-dir`: the NERSC tutorial's ViT timed next to ours at the same shape.

The tutorial is not vendored: a stand-in checkout, written here with the tutorial's interface (a
`networks/vit.py` with `ViT(params)` and a `utils/loss.py` with `l2_loss`, packages named like this
project's), records the parameters it was built with, so the test checks that the shape handed over is
the benchmark's and that the two cannot import each other's packages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=vit_tiny", "data.img_size=[16,32]", "trainer.global_batch_size=4", "--warmup", "1", "--steps", "2"]

STAND_IN_VIT = '''
import json, os
import torch
from torch import nn
import utils.loss  # the stand-in's own utils package, not the project's

class ViT(nn.Module):
    def __init__(self, params):
        super().__init__()
        with open(os.path.join(os.path.dirname(__file__), "..", "params.json"), "w") as f:
            json.dump(vars(params), f)
        self.mix = nn.Conv2d(params.n_in_channels, params.n_out_channels, params.patch_size,
                             padding="same")

    def forward(self, x):
        return self.mix(x)
'''
STAND_IN_LOSS = '''
import torch

def l2_loss(pred, target):
    return ((pred - target).flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1)).mean()
'''


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "utils.bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


@pytest.fixture
def seed_dir(tmp_path) -> Path:
    for package, source in (("networks", STAND_IN_VIT), ("utils", STAND_IN_LOSS)):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / ("vit.py" if package == "networks" else "loss.py")).write_text(source)
    return tmp_path


@pytest.mark.slow
def test_the_tutorial_vit_is_timed_at_the_same_shape(seed_dir):
    proc = bench(*TINY, "--seed-dir", str(seed_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 20")]
    assert len(rows) == 2 and "| vit_tiny |" in rows[0] and "| NERSC tutorial ViT |" in rows[1], proc.stdout
    cells = [c.strip() for c in rows[1].split("|")]
    assert cells[4:8] == ["fp32", "False", "single", "4"] and float(cells[8]) > 0
    assert json.loads((seed_dir / "params.json").read_text()) == {
        "img_size": [16, 32], "n_in_channels": 20, "n_out_channels": 20, "patch_size": 4, "embed_dim": 128,
        "depth": 4, "num_heads": 4, "dropout": 0.0}


@pytest.mark.parametrize("args,message", [
    (["--seed-dir", "/nonexistent"], "is not a checkout of the NERSC tutorial"),
    (["model=gpt_tiny", "data=wikitext_sample", "--seed-dir", "SEED"], "only a ViT with mlp_ratio 4"),
    (["model=vit_tiny", "model.mlp_ratio=2", "--seed-dir", "SEED"], "only a ViT with mlp_ratio 4"),
])
def test_shapes_the_tutorial_lacks_are_refused_in_one_line(args, message, seed_dir):
    """The bench's main in this process: its refusals come before any timed process starts."""
    code, _, err = run_main("utils.bench.train_step", *[str(seed_dir) if a == "SEED" else a for a in args])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0] and "--seed-dir" in lines[0], err


def test_tp_comparison_table_gives_both_ratios_with_their_spread():
    """`--seed-dir` at tp > 1 (utils/bench/versus_seed.py): each arm's median over the interleaved rounds, the
    lowest and highest round, and the median over the seed's, for sequence parallelism on and off."""
    from utils.bench.versus_seed import arm_command, table

    text = table({"seed": [0.30, 0.20, 0.25], "sp_on": [0.40, 0.26, 0.30], "sp_off": [0.22, 0.23, 0.18]}, 2,
                 "cpu, gloo", 3, 20)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]] for line in text.splitlines()[3:]}
    assert rows == {"NERSC tutorial ViT (its model-parallel ViT in DDP)": ["250.0", "200.0-300.0", "1.00"],
                    "this project, sequence parallelism on (the default with GPUs)": ["300.0", "260.0-400.0", "1.20"],
                    "this project, sequence parallelism off (the default on CPU)": ["220.0", "180.0-230.0", "0.88"]}
    assert "3 interleaved round(s) x 20 timed steps" in text.splitlines()[0]
    ours = arm_command("sp_off", ["model=vit_tiny", "parallel=tp2"], Path("SEED"), {}, 2, 5, 20)
    assert ours[-8:] == ["model=vit_tiny", "parallel=tp2", "parallel.sequence_parallel=false", "--warmup", "5",
                         "--steps", "20", "--json"] and "--nproc_per_node=2" in ours
    seed = arm_command("seed", [], Path("SEED"), {"batch": 8}, 2, 5, 20)
    assert seed[-3].endswith("seed_step.py") and json.loads(seed[-1]) == {"batch": 8, "tp": 2}
