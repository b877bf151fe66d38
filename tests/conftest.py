"""Pytest's hooks and the session fixtures (a synthetic ERA5 copy and a sample corpus, made once); the
helpers tests share are in tests/helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_planted_bugs.py runs the plant harness's plugin in a nested pytest


# The fast tier, `python -m pytest -m "not slow" tests` (at most 3 minutes on 2 cores), for edit-test loops:
# it leaves out the tests that train through the entry points, launch processes as users do (train_mp,
# torchrun, sbatch, Hydra launchers), compile, or run the combination matrix's training cases. The default
# suite (the README's command) runs everything.
SLOW_FILES = {"test_layouts", "test_train_e2e", "test_lm_e2e", "test_submit", "test_sweep", "test_launch",
              "test_compile", "test_comm_compile", "test_tensorboard", "test_exit_paths", "test_fsdp_pipeline"}
SLOW_TESTS = {"test_probed_meta_plan_equals_the_full_initialised_one_vit",
              "test_compiled_training_follows_eager", "test_a_nan_on_one_rank_is_handled_alike_on_every_rank",
              "test_the_tutorial_vit_is_timed_at_the_same_shape", "test_accepted_combination_follows_the_single_process_run",
              "test_refused_combination_exits_2_with_one_line", "test_table_values_are_those_of_the_events",
              "test_a_bad_argument_is_one_line_and_status_2_before_any_work",  # its fixture trains 3 runs
              "test_out_writes_the_table_csv_and_figures", "test_a_glob_expands_sorted", "test_profile_of_steps_2_to_3",
              "test_a_rollout_logs_model_and_baselines_per_channel_and_lead",
              "test_a_rollout_under_any_layout_equals_one_process", "test_bf16_rollouts_feed_predictions_back_in_float32",
              "test_without_time_means_acc_is_left_out_with_a_notice",
              "test_the_forecast_command_reads_a_checkpoint_of_another_layout",
              "test_the_forecast_command_refuses_bad_input_with_one_line",
              "test_rollout_training_follows_the_single_process_curve",
              "test_rollout_training_resumes_mid_curriculum_exactly", "test_rollout_training_changes_the_loss_from_k_2_on",
              "test_fine_tuning_starts_from_a_checkpoint_of_another_layout",
              "test_fine_tuning_from_another_model_or_no_checkpoint_is_one_line",
              "test_import_finetune_tp2pp2_export_loads_in_transformers", "test_a_pretrained_model_trains_under_every_layout",
              "test_init_from_a_folder_of_another_model_is_refused_before_work",
              "test_a_healthy_layout_passes_with_a_report_and_a_bandwidth_file", "test_a_planted_fault_fails_the_doctor"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SLOW_FILES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "the combination matrix (tests/test_matrix.py)")
    group.addoption("--matrix-seed", type=int, default=0, help="seed of the random matrix cases")
    group.addoption("--matrix-cases", type=int, default=0, help="random matrix cases to run (0: none)")


@pytest.fixture(scope="session")
def era5_root(tmp_path_factory) -> Path:
    from utils.data.era5_synthetic import ensure_synthetic

    return ensure_synthetic(tmp_path_factory.mktemp("era5") / "synthetic")


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    from utils.data.corpus import ensure_sample_corpus

    return ensure_sample_corpus(tmp_path_factory.mktemp("wikitext") / "sample")
