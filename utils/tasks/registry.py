"""The registry of model families: `model.arch` -> its `networks.spec.ModelSpec`, one line per family.

The config registers each family's schema from here (utils/cli/config.py), checks the pairing of model and
data (`utils.tasks.check_pairing`) and builds the task and its model (`utils.tasks.build_task`,
`Task.build_model`) through it. A new family is its own folder (its model, its schema) and one `register`
call: the built-in ones below, or from its own package (tests/toy_family registers a tests-only family).
"""

from __future__ import annotations

from networks.spec import ModelSpec
from networks.transformer import GPT, GPTConfig, LlamaConfig
from networks.vit import ViT, ViTConfig
from utils import ConfigError
from utils.tasks.language import LanguageTask
from utils.tasks.weather import WeatherTask

MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (the same spec again is a no-op; another spec under a taken arch is an error)."""
    assert MODELS.setdefault(spec.arch, spec) == spec, f"model.arch {spec.arch!r} is registered already"
    return spec


def spec_of(arch: str) -> ModelSpec:
    """The family of `model.arch` (a one-line error naming the registered ones)."""
    if arch not in MODELS:
        raise ConfigError(f"no model family {arch!r} is registered", "model.arch",
                          f"choose one of {', '.join(MODELS)}")
    return MODELS[arch]


def _vit(cfg: ViTConfig, task: WeatherTask) -> ViT:
    channels = len(task.cfg.channels)
    return ViT(cfg, tuple(task.cfg.img_size), channels, channels)


def _decoder(cfg: GPTConfig, task: LanguageTask) -> GPT:
    return GPT(cfg, task.vocab_size)


register(ModelSpec("vit", "ViT", ViTConfig, "model=vit_tiny, vit_base or vit_large", WeatherTask, _vit))
register(ModelSpec("gpt", "GPT", GPTConfig, "model=gpt_tiny, gpt_small or gpt_medium", LanguageTask, _decoder,
                   hf_model_types=("gpt2",)))
register(ModelSpec("llama", "Llama", LlamaConfig, "model=llama_tiny, llama_1b or llama_8b", LanguageTask, _decoder,
                   hf_model_types=("llama",)))
