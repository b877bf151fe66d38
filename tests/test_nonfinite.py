"""Non-finite values: every rank takes the same branch, skipping the update or stopping with one line.

Under tp=2 the ViT head is replicated and its gradient is each rank's own; a NaN there on rank 1 only
makes rank 1's gradient norm NaN and rank 0's finite. Without the agreed verdict rank 0 would step and
rank 1 would not, and the replicas would part for good.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import run_ranks
from tests.test_precision import make_trainer
from utils import ConfigError
from utils.cli.config import load_config
from utils.engine.step_results import StepResult


def _one_rank_nan(rank: int, world_size: int, run_dir: str, era5_root: str, policy: str) -> None:
    trainer = make_trainer(run_dir, f"data.root={era5_root}", "parallel=tp2", "trainer.global_batch_size=8",
                           f"trainer.nonfinite={policy}", "trainer.max_skipped_steps=2")
    hook = trainer.raw_model.head.weight.register_hook(lambda g: torch.full_like(g, math.nan) if rank == 1 else g)
    before = [p.detach().clone() for p in trainer.raw_model.parameters()]
    batches = trainer.train_batches()
    loss, norm = trainer.train_step(*next(batches))
    assert trainer.skipped and math.isfinite(loss.item()) and (rank == 1) == math.isnan(norm.item())
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.raw_model.parameters())), "an update happened"
    assert all(int(s["step"]) == 0 for s in trainer.optimizer.state.values()), "Adam counted a skipped step"
    result = StepResult(1, 1e-3, 0.0, 0.0, loss=loss.item(), grad_norm=norm.item(), bad=True)
    if policy == "stop":
        with pytest.raises(ConfigError, match=r"non-finite .* at step 1 \(trainer.nonfinite\)"):
            trainer.apply_nonfinite_policy(result)
        return
    for expected in (1, 2):  # counted, then stopped after max_skipped_steps=2 in a row
        trainer.apply_nonfinite_policy(result)
        assert trainer.skipped_steps == expected
    with pytest.raises(ConfigError, match="trainer.max_skipped_steps"):
        trainer.apply_nonfinite_policy(result)
    hook.remove()
    trainer.train_step(*next(batches))
    assert not trainer.skipped and not all(torch.equal(a, p) for a, p in zip(before, trainer.raw_model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_nan_on_one_rank_is_handled_alike_on_every_rank(policy, tmp_path, era5_root):
    run_ranks(_one_rank_nan, 2, tmp_path, str(tmp_path / "run"), str(era5_root), policy, timeout_s=120)


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.nonfinite=ignore"])
    assert info.value.setting == "trainer.nonfinite"
