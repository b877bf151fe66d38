"""The weather task's losses (utils/weather/task/weather_loss.py) against GraphCast's definition written out here, the
default left the seed's, the weights built on meta and computed on the device; and the task's own settings
(utils/weather/task/weather.py): the forecast evaluation is resume-safe, the language task has none of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from networks.vit.model import RelativeL2Loss
from utils.checkpoints.run_dir import differences
from utils.cli.config import load_config
from utils.cli.runs import override_digest
from utils.engine.materialize import materialize
from utils.tasks import build_task
from utils.weather.data.era5 import CHANNELS, nersc_channel
from utils.weather.data.fields import Channel, cell_area_weights
from utils.weather.task.weather_loss import GRAPHCAST_WEIGHTS, WeightedMSE, channel_weights, loss_table

CHANNELS_ZARR = [Channel("2m_temperature", "2m_temperature", None, "K"),
                 Channel("10m_u_component_of_wind", "10m_u_component_of_wind", None, "m/s"),
                 Channel("geopotential@500", "geopotential", 500, "m^2/s^2"),
                 Channel("geopotential@850", "geopotential", 850, "m^2/s^2"),
                 Channel("temperature@250", "temperature", 250, "K"),
                 Channel("temperature@1000", "temperature", 1000, "K")]


def graphcast_loss(pred, target, channels, latitudes, weights) -> float:
    """GraphCast's weighted_mse_per_level, written per variable: each variable's squared error times the latitude
    weights (cos-latitude cell areas, mean 1) and, on levels, level / mean(level), averaged over (batch, level,
    lat, lon), times the variable's weight, summed over variables."""
    lat_w = cell_area_weights(latitudes).numpy()[:, 0]
    total = 0.0
    for variable in dict.fromkeys(c.variable for c in channels):
        idx = [i for i, c in enumerate(channels) if c.variable == variable]
        err = (pred[:, idx] - target[:, idx]) ** 2 * lat_w[:, None]  # (B, L, H, W)
        if channels[idx[0]].level is not None:
            levels = np.array([channels[i].level for i in idx], dtype=np.float64)
            err = err * (levels / levels.mean())[None, :, None, None]
        total += weights.get(variable, 1.0) * err.mean()
    return total


def test_weighted_mse_is_graphcasts_per_variable_and_pressure_level_loss():
    rng = np.random.default_rng(0)
    pred, target = rng.normal(size=(3, 6, 8, 16)), rng.normal(size=(3, 6, 8, 16))
    lat = np.linspace(-78.75, 78.75, 8)  # ascending, no poles
    table = loss_table("weighted_mse", CHANNELS_ZARR, lat, GRAPHCAST_WEIGHTS)
    got = WeightedMSE(table)(torch.from_numpy(pred), torch.from_numpy(target)).item()
    assert got == pytest.approx(graphcast_loss(pred, target, CHANNELS_ZARR, lat, GRAPHCAST_WEIGHTS), rel=1e-6)


def test_channel_weights_share_each_variables_weight_by_pressure():
    w = channel_weights(CHANNELS_ZARR, GRAPHCAST_WEIGHTS)
    np.testing.assert_allclose(w[:2], [1.0, 0.1])  # GraphCast's surface weights
    np.testing.assert_allclose(w[2:4], [500 / 675 / 2, 850 / 675 / 2])  # proportional to pressure, summing to 1
    assert w[4] / w[5] == pytest.approx(0.25) and w[4] + w[5] == pytest.approx(1.0)
    nersc = channel_weights([nersc_channel(c) for c in CHANNELS], {"geopotential": 2.0})
    z = [i for i, c in enumerate(CHANNELS) if c.startswith("z")]  # z1000, z850, z500, z50
    assert nersc[z].sum() == pytest.approx(2.0) and nersc[CHANNELS.index("u10m")] == pytest.approx(1.0)


def test_mse_and_area_mse():
    rng = np.random.default_rng(1)
    pred, target = torch.from_numpy(rng.normal(size=(2, 3, 4, 8))), torch.from_numpy(rng.normal(size=(2, 3, 4, 8)))
    channels, lat = CHANNELS_ZARR[:3], np.array([67.5, 22.5, -22.5, -67.5])
    mse = WeightedMSE(loss_table("mse", channels, lat, {}))(pred, target)
    torch.testing.assert_close(mse, torch.nn.functional.mse_loss(pred.float(), target.float()))
    area = WeightedMSE(loss_table("area_mse", channels, lat, {}))(pred, target)
    w = cell_area_weights(lat).float()
    torch.testing.assert_close(area, ((pred.float() - target.float()) ** 2 * w).mean())


def test_the_weights_are_computed_again_on_the_device_after_a_meta_build():
    table = loss_table("area_mse", CHANNELS_ZARR, np.linspace(80, -80, 8), {})
    with torch.device("meta"):
        module = WeightedMSE(table)
    assert module.weights.is_meta and "weights" not in module.state_dict()  # not checkpointed
    materialize(module, torch.device("cpu"), rules=None, seed=0)
    torch.testing.assert_close(module.weights, torch.from_numpy(table))


@pytest.mark.parametrize("loss", ["relative_l2", "weighted_mse"])
def test_the_models_criterion_is_the_configured_loss(era5_root, loss):
    """The default keeps the ViT's own criterion (the seed's numbers); a weighted loss replaces it, with the
    synthetic copy's latitudes, so that a pipeline's last stage computes it too."""
    cfg, _, _ = load_config([f"data.root={era5_root}", f"task.loss={loss}", "data.limit_nsamples_val=2"])
    task = build_task(cfg)
    with torch.device("meta"):
        model = task.build_model()
    if loss == "relative_l2":
        assert type(model.criterion) is RelativeL2Loss
        return
    materialize(model.criterion, torch.device("cpu"), rules=None, seed=0)
    channels = [nersc_channel(c) for c in CHANNELS]
    want = loss_table(loss, channels, task.val_set.reader.latitudes, GRAPHCAST_WEIGHTS)
    torch.testing.assert_close(model.criterion.weights, torch.from_numpy(want))


def test_evaluation_settings_are_resume_safe_and_training_settings_not(era5_root):
    base = load_config([f"data.root={era5_root}"])[2]
    _, choices, evaluation = load_config([f"data.root={era5_root}", "task.eval.every=5", "task.eval.steps=4",
                                          "task.eval.inits=2", "task.eval.members=8",
                                          "task.eval.perturbation_std=0.1", "task.eval.perturbation_length=0"])
    training = load_config([f"data.root={era5_root}", "task.loss=area_mse", "task.rollout_train_steps=2"])[2]
    assert differences(base, evaluation) == []  # the resume is not refused
    assert override_digest(evaluation, choices) == ""  # nor the run renamed (data.root is resume-safe too)
    assert differences(base, training) == ["task.loss: relative_l2 -> area_mse", "task.rollout_train_steps: 1 -> 2"]


def test_the_language_task_has_no_weather_settings(corpus_root):
    cfg, _, yaml = load_config(["model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}"])
    assert OmegaConf.create(yaml).task == {"kind": "language"} and cfg.task.kind == "language"
