"""The ERA5 Vision Transformer family (`model=vit_*`): its model and schema (model.py), trained by the weather task."""

from networks.layout import check_heads
from networks.spec import ModelSpec
from networks.vit.model import ViT, ViTConfig


def _build(cfg: ViTConfig, task) -> ViT:
    channels = len(task.cfg.channels)
    return ViT(cfg, tuple(task.cfg.img_size), channels, channels)


FAMILY = ModelSpec(arch="vit", name="ViT", schema=ViTConfig, presets="model=vit_tiny, vit_base or vit_large",
                   tiny="vit_tiny", task="weather", build=_build, blocks=lambda cfg: cfg.depth,
                   check_layout=lambda cfg, parallel: check_heads(cfg.num_heads, parallel))
