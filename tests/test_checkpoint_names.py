"""A checkpoint names every tensor as the single-process model does, whatever wraps the blocks.

Activation checkpointing wraps each block in torch's checkpoint wrapper, which adds
`_checkpoint_wrapped_module.` to `named_parameters()` but not to state-dict keys: the Adam state must be
named like the model, or a checkpoint written with it on cannot resume with it off, under another
layout, or be exported with the right names (issue 23, item 3)."""

from __future__ import annotations

import pytest

from tests.helpers import QUIET, read_scalars
from tests.rank_pool import run_entry_ranks

TINY = [*QUIET, "model.depth=2", "trainer.global_batch_size=4", "data.limit_nsamples_val=4",
        "trainer.ckpt_every=2", "trainer.log_every=1", "trainer.max_steps=4"]


def train(run_dir, root, *args) -> None:
    results = run_entry_ranks([*TINY, f"data.root={root}", f"run.dir={run_dir}", *args], 1)
    assert results[0].value == 0, results[0].error or results[0].stdout[-2000:] + results[0].stderr[-2000:]


def losses(run_dir) -> list[float]:
    return [v for _, v in read_scalars(run_dir)["train/loss"]]


@pytest.mark.parametrize("first,then", [("true", "false"), ("false", "true")])
def test_resume_with_activation_checkpointing_toggled(first, then, tmp_path, era5_root):
    from utils.checkpoints.sharded_state import read_shapes

    reference = tmp_path / "reference"
    train(reference, era5_root)
    run_dir = tmp_path / "toggled"
    train(run_dir, era5_root, f"trainer.activation_checkpointing={first}", "trainer.stop_at_step=2")
    saved = read_shapes(run_dir / "checkpoints" / "step_0000002")
    assert saved.keys() == read_shapes(reference / "checkpoints" / "step_0000002").keys()
    assert not [k for k in saved if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
    train(run_dir, era5_root, f"trainer.activation_checkpointing={then}")
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-6)
