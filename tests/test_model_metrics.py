"""ViT shapes and FLOP inputs; the relative L2 loss and latitude-weighted RMSE."""

import pytest
import torch

from networks.vit.model import RelativeL2Loss, ViT, ViTConfig
from utils import ConfigError
from utils.cli.config import load_config
from utils.weather.task.weather_metrics import weighted_rmse


def test_vit_maps_fields_to_fields():
    model = ViT(ViTConfig(embed_dim=32, depth=2, num_heads=4, patch_size=4), (16, 32), 5, 5)
    x = torch.randn(3, 5, 16, 32)
    assert model(x).shape == (3, 5, 16, 32)
    assert model.num_tokens() == 32
    torch.testing.assert_close(model.unpatchify(model.patchify(x)), x)


def test_vit_base_size_matches_the_seed():
    model = ViT(ViTConfig(embed_dim=384, depth=12, num_heads=8, patch_size=8), (360, 720), 20, 20)
    blocks = 12 * (4 * 384 * 384 + 2 * 384 * 4 * 384)
    assert model.matmul_params() == blocks + 2 * 20 * 64 * 384
    assert model.num_tokens() == 4050


def test_bad_model_settings():
    with pytest.raises(ConfigError, match="num_heads"):
        ViTConfig(embed_dim=30, num_heads=4)
    with pytest.raises(ConfigError) as info:  # a rule between two groups: checked by the Config schema
        load_config(["model.patch_size=8", "data.img_size=[20,32]"])
    assert info.value.setting == "data.img_size"


def test_relative_l2_loss():
    target = torch.ones(2, 3, 4, 4)
    assert RelativeL2Loss()(target, target).item() == 0.0
    assert RelativeL2Loss()(torch.zeros_like(target), target).item() == pytest.approx(1.0)
    assert RelativeL2Loss()(1.5 * target, target).item() == pytest.approx(0.5)
    # norms over the whole sample (the seed's l2_loss_opt), not per channel: an error of 1 on one of two
    # channels of scales 1 and 3 gives sqrt(16) / sqrt(16 + 144) = 0.316 (per channel it would be 0.5)
    target = torch.cat([torch.ones(1, 1, 4, 4), 3 * torch.ones(1, 1, 4, 4)], dim=1)
    pred = target.clone()
    pred[:, 0] += 1
    assert RelativeL2Loss()(pred, target).item() == pytest.approx(4 / 160 ** 0.5)


def test_weighted_rmse_per_channel():
    pred, target = torch.zeros(2, 2, 4, 3), torch.zeros(2, 2, 4, 3)
    pred[:, 1] = 2.0
    weights = torch.ones(4, 1)
    torch.testing.assert_close(weighted_rmse(pred, target, weights), torch.tensor([0.0, 2.0]))
    weights = torch.tensor([[0.0], [2.0], [2.0], [0.0]])  # mean 1
    pred[:, 1, 0] = 100.0  # errors on a zero-weight row do not count
    torch.testing.assert_close(weighted_rmse(pred, target, weights), torch.tensor([0.0, 2.0]))
