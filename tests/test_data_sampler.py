"""Global batches are independent of dp and of where a run resumes."""

import pytest

from utils import ConfigError
from utils.data.batching import GlobalBatchSampler, check_batch, contiguous_part
from utils.schema import TrainerConfig


def take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_split_the_same_global_batch(dp):
    serial = take(GlobalBatchSampler(50, 8, 0, 1, seed=3), 14)  # crosses epochs (6 steps per epoch)
    ranks = [take(GlobalBatchSampler(50, 8, r, dp, seed=3), 14) for r in range(dp)]
    for step in range(14):
        assert sum((ranks[r][step] for r in range(dp)), []) == serial[step]


def test_resume_continues_the_sequence_and_epochs_differ():
    full = take(GlobalBatchSampler(50, 8, 0, 1, seed=1), 20)
    assert take(GlobalBatchSampler(50, 8, 0, 1, seed=1, start_step=9), 11) == full[9:]
    assert full[0] != full[6] and len(set(full[0])) == 8
    assert take(GlobalBatchSampler(50, 8, 0, 1, seed=2), 1) != full[:1]


def test_validation_shards_cover_everything():
    parts = [list(contiguous_part(10, r, 3)) for r in range(3)]
    assert sum(parts, []) == list(range(10))


@pytest.mark.parametrize("args,setting", [((6, 4, 1, 100), "trainer.global_batch_size"),
                                          ((8, 2, 3, 100), "trainer.global_batch_size"),
                                          ((64, 1, 1, 10), "trainer.global_batch_size")])
def test_bad_batch_settings(args, setting):
    with pytest.raises(ConfigError) as info:
        check_batch(*args)
    assert info.value.setting == setting


@pytest.mark.parametrize("field", ["global_batch_size", "grad_accum_steps"])
def test_batch_signs_are_the_trainer_schemas(field):
    """Zero batches are refused once, by TrainerConfig, not again by check_batch."""
    with pytest.raises(ConfigError) as info:
        TrainerConfig(**{field: 0})
    assert info.value.setting == f"trainer.{field}"
