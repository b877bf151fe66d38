"""Forecast skill (utils/weather/task/forecast.py): WeatherBench 2's metrics against an independent computation on
hand-made fields, rollouts under every kind of layout equal to one process, and the bad inputs."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tests.helpers import QUIET, read_scalars, read_tags, run_main
from tests.rank_pool import run_entry_ranks
from utils.weather.task.forecast import cell_area_weights, skill, skill_sums

ROLLOUT = [*QUIET, "trainer.max_steps=1", "task.eval.every=1", "task.eval.steps=3",
           "task.eval.inits=4", "trainer.global_batch_size=4", "data.limit_nsamples_val=4", "task.eval.members=2"]


def test_cell_area_weights_are_wb2s():
    """Rows at 90, 45, 0, -45, -90 degrees: cell areas between the bounds +-22.5 degrees, clipped at the poles."""
    got = cell_area_weights(5).squeeze(-1).numpy()
    lat = np.array([90.0, 45.0, 0.0, -45.0, -90.0])
    upper, lower = np.minimum(lat + 22.5, 90.0), np.maximum(lat - 22.5, -90.0)
    area = np.sin(np.deg2rad(upper)) - np.sin(np.deg2rad(lower))
    np.testing.assert_allclose(got, area / area.mean(), rtol=1e-12)
    assert got.mean() == pytest.approx(1.0) and got[0] == pytest.approx(got[-1]) and got[0] < got[2]


def _independent(f, o, w, clim):
    """The WB2 formulas written out with numpy loops over initial times and channels."""
    times, channels = f.shape[:2]
    rmse, bias, acc = np.zeros(channels), np.zeros(channels), np.zeros(channels)
    for c in range(channels):
        mse = [np.mean(w * (f[t, c] - o[t, c]) ** 2) for t in range(times)]
        rmse[c] = math.sqrt(np.mean(mse))
        bias[c] = np.mean([np.mean(w * (f[t, c] - o[t, c])) for t in range(times)])
        accs = []
        for t in range(times):
            fa, oa = f[t, c] - clim[c], o[t, c] - clim[c]
            accs.append(np.sum(w * fa * oa) / math.sqrt(np.sum(w * fa ** 2) * np.sum(w * oa ** 2)))
        acc[c] = np.mean(accs)
    return rmse, bias, acc


def _metrics(f, o, w, clim):
    return skill(skill_sums(torch.from_numpy(f), torch.from_numpy(o), torch.from_numpy(w), torch.from_numpy(clim)),
                 len(f))


def test_metrics_match_an_independent_computation():
    rng = np.random.default_rng(0)
    f, o = rng.normal(size=(5, 3, 8, 16)), rng.normal(size=(5, 3, 8, 16))
    clim = rng.normal(size=(3, 8, 16)) * 0.3
    w = cell_area_weights(8).numpy()
    got = _metrics(f, o, w, clim)
    for name, want in zip(("rmse", "bias", "acc"), _independent(f, o, w, clim)):
        np.testing.assert_allclose(got[name].numpy(), want, rtol=1e-12)


def test_perfect_climatological_and_biased_forecasts():
    rng = np.random.default_rng(1)
    o = rng.normal(size=(4, 2, 8, 16))
    clim = rng.normal(size=(2, 8, 16))
    w = cell_area_weights(8).numpy()
    perfect = _metrics(o.copy(), o, w, clim)
    assert perfect["rmse"].abs().max() == 0 and perfect["bias"].abs().max() == 0
    np.testing.assert_allclose(perfect["acc"].numpy(), 1.0, rtol=1e-12)
    climatological = _metrics(np.broadcast_to(clim, o.shape).copy(), o, w, clim)
    assert torch.isnan(climatological["acc"]).all()  # no forecast anomaly: undefined, as WB2 says
    biased = _metrics(o + 0.7, o, w, clim)
    np.testing.assert_allclose(biased["rmse"].numpy(), 0.7, rtol=1e-12)  # weights of mean 1
    np.testing.assert_allclose(biased["bias"].numpy(), 0.7, rtol=1e-12)


def _rollout_scalars(run_dir) -> dict[str, float]:
    scalars = read_scalars(run_dir)
    return {tag: values[-1][1] for tag, values in scalars.items() if tag.startswith(("rollout/", "baseline/"))}


@pytest.fixture(scope="module")
def single(era5_root, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("forecast") / "single"
    results = run_entry_ranks([*ROLLOUT, "trainer.log_images=true", f"data.root={era5_root}", f"run.dir={run_dir}"],
                              1)  # the figures too (QUIET leaves them out)
    assert [r.value for r in results] == [0], results[0].error or results[0].stderr[-2000:]
    return run_dir


@pytest.mark.slow
def test_a_rollout_logs_model_and_baselines_per_channel_and_lead(single):
    scalars = _rollout_scalars(single)
    for lead in ("6h", "12h", "18h"):
        for prefix in ("rollout", "baseline/persistence"):
            assert {f"{prefix}/{m}/u10m/{lead}" for m in ("rmse", "acc", "bias")} <= set(scalars)
        assert f"baseline/climatology/rmse/t2m/{lead}" in scalars
        assert f"baseline/climatology/acc/t2m/{lead}" not in scalars  # undefined: not logged
    assert not any(tag.startswith("rollout/") and "/24h" in tag for tag in scalars)  # 3 steps of 6 h
    persistence = [scalars[f"baseline/persistence/rmse/u10m/{h}h"] for h in (6, 12, 18)]
    assert persistence == sorted(persistence)  # persistence degrades with lead on these waves
    images = set(read_tags(single)["images"])
    assert {f"rollout/{kind}_{c}" for kind in ("skill", "spectra") for c in ("u10m", "t2m", "z500")} <= images
    for lead in ("6h", "12h", "18h"):  # the spectra's blurring figure and the ensemble of task.eval.members=2
        assert {f"rollout/{m}/u10m/{lead}" for m in ("blurring", "crps", "spread_skill")} <= set(scalars)
    assert 0 < scalars["rollout/blurring/u10m/6h"] < 10 and scalars["rollout/crps/u10m/18h"] > 0


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2"], ["parallel.cp=2"], ["parallel.pp=2"], ["parallel.dp=2", "parallel.dp_mode=fsdp"],
    ["parallel.tp=2", "parallel.cp=2"], ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp"],
], ids=lambda layout: "-".join(s.split(".")[1] for s in layout))
@pytest.mark.slow
def test_a_rollout_under_any_layout_equals_one_process(layout, single, era5_root, tmp_path):
    """fp32, one training step then a 3-step rollout from 4 initial times: the same numbers (1e-5)."""
    run_dir = tmp_path / "run"
    results = run_entry_ranks([*ROLLOUT, f"data.root={era5_root}", f"run.dir={run_dir}", *layout])
    assert {r.value for r in results} == {0}, [r.error or r.stderr[-2000:] for r in results]
    want, got = _rollout_scalars(single), _rollout_scalars(run_dir)
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


class _Rollouts:
    """Two initial times of 3 channels on a 4 x 8 grid, 3 steps, in place of the files (Rollouts' interface)."""
    starts, steps, img_size, climatology = [(0, 0), (0, 1)], 3, (4, 8), None
    latitudes = np.array([67.5, 22.5, -22.5, -67.5])
    means, stds = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1), torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1)

    def read(self, index):
        gen = torch.Generator().manual_seed(index)
        return torch.randn(3, 4, 8, generator=gen), torch.randn(self.steps, 3, 4, 8, generator=gen)


def test_rollouts_feed_predictions_back_in_float32():
    """Under bf16 autocast the model's output is bf16; each later step's input must be that output cast back to
    float32 (rounded to bf16 once per step, not carried in bf16), and the forecast kept is float32."""
    from utils.comm import init_grid
    from utils.schema import ParallelConfig
    from utils.weather.task.forecast import rollout_skill

    conv = torch.nn.Conv2d(3, 3, 1)
    inputs, outputs = [], []

    def model(x):
        inputs.append(x)
        outputs.append(conv(x))
        return outputs[-1]

    kept = []
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 (the trainer's autocast factory)
    skill_of = rollout_skill(model, _Rollouts(), grid=init_grid(ParallelConfig()), autocast=autocast,
                             with_baselines=True, keep=kept)
    assert len(inputs) == 3 and all(o.dtype == torch.bfloat16 for o in outputs)  # autocast acted
    assert [x.dtype for x in inputs] == [torch.float32] * 3
    for before, after in zip(outputs, inputs[1:]):
        assert torch.equal(after, before.float())  # the prediction itself, in float32
    assert kept[0].dtype == torch.float32 and torch.isfinite(skill_of["model"]["rmse"]).all()


@pytest.mark.slow
def test_bf16_rollouts_follow_the_fp32_rollout(single, era5_root, tmp_path):
    """Through the entry point: a bf16 run's rollout RMSE within bf16's 8 roundoffs of the fp32 run's."""
    run_dir = tmp_path / "bf16"
    results = run_entry_ranks([*ROLLOUT, f"data.root={era5_root}", f"run.dir={run_dir}", "precision=bf16"], 1)
    assert [r.value for r in results] == [0]
    want, got = _rollout_scalars(single), _rollout_scalars(run_dir)
    rmse = [tag for tag in want if tag.startswith("rollout/rmse/")]
    assert all(math.isfinite(got[tag]) for tag in got)
    assert [got[t] for t in rmse] == pytest.approx([want[t] for t in rmse], rel=3e-2)  # bf16's 8 roundoffs


@pytest.mark.parametrize("args,line", [
    (["task.eval.every=1", "task.eval.steps=40"],
     "error: a rollout of 40 steps of dt=1 needs 40 times after each of 8 initial times, and the validation split "
     "holds 0 such starts (segments of at most 32 times) (task.eval.steps): use task.eval.steps <= 24 or fewer "
     "task.eval.inits"),
    (["model=gpt_tiny", "data=wikitext_sample", "task.eval.every=5"],  # the language task has no such setting
     "error: unknown setting 'task.eval.every' (task.eval.every=5): check the spelling; `python train.py --cfg` "
     "prints every setting"),
    (["task.eval.steps=0"],
     "error: steps must be positive (task.eval.steps): set a positive integer"),
    (["task.eval.members=-1"],
     "error: members must be >= 0 (task.eval.members): set 0 (none) or 2 or more"),
    (["task.eval.perturbation_std=-0.1"],
     "error: perturbation_std must be >= 0 (task.eval.perturbation_std): set a value >= 0"),
    (["task.rollout_train_steps=2", "parallel.pp=2"],
     "error: task.rollout_train_steps=2 with parallel.pp=2: a rollout feeds the last stage's prediction back to "
     "the first stage within one step, which the pipeline schedules do not do (task.rollout_train_steps): use "
     "parallel.pp=1 (tp, cp, dp and fsdp run rollout training), or rollout_train_steps=1"),
])
def test_bad_rollout_settings_are_one_line_and_exit_2(args, line, era5_root, corpus_root):
    root = corpus_root if "data=wikitext_sample" in args else era5_root
    code, _, err = run_main("train.py", f"data.root={root}", *args)
    assert code == 2 and err.strip().splitlines() == [line]


@pytest.mark.slow
def test_without_time_means_acc_is_left_out_with_a_notice(era5_root, tmp_path):
    """A data folder without stats/time_means.npy: RMSE and bias are still reported, ACC and the climatology
    baseline are not, and the run's data line says so."""
    root = tmp_path / "era5"
    (root / "stats").mkdir(parents=True)
    for split in ("train", "valid"):
        os.symlink(era5_root / split, root / split)
    for name in ("global_means.npy", "global_stds.npy"):
        os.symlink(era5_root / "stats" / name, root / "stats" / name)
    run_dir = tmp_path / "run"
    results = run_entry_ranks([*ROLLOUT, f"data.root={root}", f"run.dir={run_dir}"], 1)
    assert [r.value for r in results] == [0], results[0].error
    scalars = _rollout_scalars(run_dir)
    assert "rollout/rmse/u10m/6h" in scalars and "baseline/persistence/rmse/u10m/6h" in scalars
    assert not any("/acc/" in tag or "climatology" in tag for tag in scalars)
    assert "no stats/time_means.npy: rollout ACC and the climatology baseline are left out" in \
        (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_the_forecast_command_reads_a_checkpoint_of_another_layout(era5_root, tmp_path):
    """A tp2 run's checkpoint, forecast in one process: the HDF5 file reads back with the stated shapes, the
    tables and figures are written, and its skill is the rollout the run logged (same weights, same inits)."""
    import h5py

    from utils.forecast.report import main

    run_dir = tmp_path / "run"
    results = run_entry_ranks([*ROLLOUT, f"data.root={era5_root}", f"run.dir={run_dir}", "parallel.tp=2"])
    assert {r.value for r in results} == {0}
    out = tmp_path / "forecast"
    step = run_dir / "checkpoints" / "step_0000001"
    assert main([str(step), "--steps", "3", "--init", "4", "--map-leads", "1", "--out", str(out),
                 f"data.root={era5_root}"]) == 0
    with h5py.File(out / "forecast.h5") as f:
        assert f["forecast"].shape == f["truth"].shape == (4, 3, 20, 32, 64)
        assert f["init"].shape == (4, 2) and list(f.attrs["lead_hours"]) == [6, 12, 18]
        assert list(f.attrs["channels"])[0] == "u10m"
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0] == "channel,lead_h,forecast,rmse,acc,bias" and len(rows) == 1 + 20 * 3 * 3
    logged = _rollout_scalars(run_dir)
    table = {(c, int(h), n): float(r) for c, h, n, r, *_ in (row.split(",") for row in rows[1:])}
    assert table[("u10m", 12, "model")] == pytest.approx(logged["rollout/rmse/u10m/12h"], rel=1e-5)
    assert table[("t2m", 18, "persistence")] == pytest.approx(logged["baseline/persistence/rmse/t2m/18h"], rel=1e-5)
    channels = ("u10m", "t2m", "z500")
    assert {p.name for p in out.glob("*.png")} == {f"{kind}_{c}{lead}.png" for c in channels
                                                   for kind, lead in (("skill", ""), ("map", "_6h"), ("spectra", ""))}
    at = tmp_path / "at"  # initial times given by their indices in the validation split
    assert main([str(step), "--steps", "3", "--init", "0,5", "--out", str(at), f"data.root={era5_root}"]) == 0
    with h5py.File(at / "forecast.h5") as f:
        assert f["init"][:].tolist() == [[0, 0], [0, 5]] and f["forecast"].shape[:2] == (2, 3)


@pytest.mark.slow
def test_the_forecast_command_refuses_bad_input_with_one_line(era5_root, corpus_root, tmp_path, capsys):
    from utils.forecast.report import main

    lm = tmp_path / "lm"
    results = run_entry_ranks([*QUIET, "model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}",
                               "trainer.max_steps=1", "trainer.global_batch_size=4", f"run.dir={lm}"], 1)
    assert [r.value for r in results] == [0]
    cases = {lm / "checkpoints" / "step_0000001": "is a checkpoint of the gpt model, not of a ViT model",
             tmp_path / "nowhere" / "checkpoints" / "step_0000001": "does not exist (CHECKPOINT)"}
    for checkpoint, what in cases.items():
        with pytest.raises(SystemExit) as exit_:
            main([str(checkpoint), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and what in err[0]
    vit = tmp_path / "vit"
    assert [r.value for r in run_entry_ranks([*ROLLOUT, f"data.root={era5_root}", f"run.dir={vit}"], 1)] == [0]
    with pytest.raises(SystemExit) as exit_:  # 1 time left after index 30 of the 32 in the file, 3 needed
        main([str(vit / "checkpoints" / "step_0000001"), "--steps", "3", "--init", "0,30", "--out",
              str(tmp_path / "out"), f"data.root={era5_root}"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "error: initial time 30 is 1 times before the end of 2018.h5, a rollout needs 3 (--init): choose an earlier "
        "initial time or fewer steps"]


ROLLOUT_TRAINING = [*QUIET, "trainer.max_steps=4", "trainer.global_batch_size=4", "data.limit_nsamples_val=4",
                    "task.rollout_train_steps=3", "task.rollout_train_every=2", "trainer.log_every=1",
                    "trainer.activation_checkpointing=true"]  # K = 1, 1, 2, 2 over the 4 steps


def _losses(run_dir) -> list[float]:
    return [v for _, v in read_scalars(run_dir)["train/loss"]]


@pytest.fixture(scope="module")
def rollout_single(era5_root, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rollout_training") / "single"
    results = run_entry_ranks([*ROLLOUT_TRAINING, f"data.root={era5_root}", f"run.dir={run_dir}"], 1)
    assert [r.value for r in results] == [0], results[0].error or results[0].stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.tp=2"], ["parallel.cp=2"],
                                    ["parallel.dp=2", "parallel.dp_mode=fsdp"]],
                         ids=lambda layout: "-".join(s.split(".")[1] for s in layout))
@pytest.mark.slow
def test_rollout_training_follows_the_single_process_curve(layout, rollout_single, era5_root, tmp_path):
    """Backpropagation through K predicted steps, K raised by the curriculum at step 2: every layout's losses
    and validation are the single process's (fp32, 1e-4), and K > 1 changes the loss (it is not one-step)."""
    run_dir = tmp_path / "run"
    results = run_entry_ranks([*ROLLOUT_TRAINING, f"data.root={era5_root}", f"run.dir={run_dir}", *layout])
    assert {r.value for r in results} == {0}, [r.error or r.stderr[-2000:] for r in results]
    assert _losses(run_dir) == pytest.approx(_losses(rollout_single), rel=1e-4)
    want, got = read_scalars(rollout_single)["val/loss"], read_scalars(run_dir)["val/loss"]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4)


@pytest.mark.slow
def test_rollout_training_resumes_mid_curriculum_exactly(rollout_single, era5_root, tmp_path):
    run_dir = tmp_path / "resumed"
    argv = [*ROLLOUT_TRAINING, f"data.root={era5_root}", f"run.dir={run_dir}"]
    assert [r.value for r in run_entry_ranks([*argv, "trainer.stop_at_step=3"], 1)] == [0]
    assert [r.value for r in run_entry_ranks(argv, 1)] == [0]
    assert _losses(run_dir) == _losses(rollout_single)  # bitwise: the same layout, K a function of the step


@pytest.mark.slow
def test_rollout_training_changes_the_loss_from_k_2_on(rollout_single, era5_root, tmp_path):
    """The curriculum's first steps (K = 1) are one-step training on the same samples; from step 3 (K = 2)
    the loss is the rollout's, so it differs from a run with the horizon read but K held at 1."""
    run_dir = tmp_path / "k1"
    argv = [*ROLLOUT_TRAINING, f"data.root={era5_root}", f"run.dir={run_dir}", "task.rollout_train_every=100"]
    assert [r.value for r in run_entry_ranks(argv, 1)] == [0]
    one_step, rolled = _losses(run_dir), _losses(rollout_single)
    assert one_step[:2] == rolled[:2] and one_step[2] != pytest.approx(rolled[2], rel=1e-3)


@pytest.mark.slow
def test_fine_tuning_starts_from_a_checkpoint_of_another_layout(single, era5_root, tmp_path):
    """trainer.init_from: the single-process run's weights under tp2 in a new run, at step 0 with a fresh
    optimizer and schedule: its validation before the first step is the source run's validation at the
    end (the same weights and data, 1e-5), and a curriculum starts again at K = 1."""
    step = single / "checkpoints" / "step_0000001"
    run_dir = tmp_path / "ft"
    argv = [*ROLLOUT, f"data.root={era5_root}", f"run.dir={run_dir}", "parallel.tp=2", f"trainer.init_from={step}",
            "trainer.val_at_start=true"]
    results = run_entry_ranks(argv)
    assert {r.value for r in results} == {0}, [r.error or r.stderr[-2000:] for r in results]
    source, tuned = read_scalars(single)["val/loss"], read_scalars(run_dir)["val/loss"]
    assert tuned[0][0] == 0 and tuned[0][1] == pytest.approx(source[-1][1], rel=1e-5)
    assert "model weights from" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_fine_tuning_from_another_model_or_no_checkpoint_is_one_line(single, era5_root, tmp_path, capsys):
    code, _, err = run_main("train.py", f"data.root={era5_root}", f"run.dir={tmp_path / 'a'}",
                            f"trainer.init_from={tmp_path / 'none'}")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {tmp_path / 'none'} does not exist (trainer.init_from): give a run directory, its checkpoints/ "
        "folder or a step_* folder, or a Hugging Face model folder"]
    results = run_entry_ranks([*QUIET, f"data.root={era5_root}", f"run.dir={tmp_path / 'b'}", "model.depth=2",
                               "trainer.max_steps=1",
                               f"trainer.init_from={single / 'checkpoints' / 'step_0000001'}"], 1)
    assert [r.value for r in results] == [2] and "holds another model" in results[0].stderr
