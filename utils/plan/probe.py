"""Planning without the wait: one Hydra composition for every layout, and a deep model's figures from
two shallow builds of it.

Configs: `LayoutConfigs` composes the user's overrides once; a layout's config is that composition with
its settings (parallel sizes, a probe depth) set on a copy, then converted and checked as
utils.cli.config.load_config does (the same `typed_config`, so a refused layout gets the same line).

Depth: the blocks of a model are `depth` copies of one module (same shapes, same collectives) between an
embedding and a head that do not depend on the depth. Every figure the planner measures is then an exact
affine function of the depth: the weights, gradients and Adam state rank 0 holds (per-block tensors), the
bytes it sends on each axis (per-block collectives; DDP all-reduces every gradient once), and the peak of
the tensors saved for backward (per block, plus one interface per pair of neighbouring blocks; under
activation checkpointing the blocks' inputs plus one recomputed block). So the planner takes the real
step at depths d and d + 1 (`PROBE_DEPTHS`) and extends the line to the configured depth in integer
arithmetic: the same numbers as a full-depth step. Before it does, the serial model's parameter count,
built on the meta device at the two probe depths and at the full one, must lie on the same line (a model
with blocks of different shapes is measured at full depth instead). tests/test_plan.py checks the
extended figures against full-depth steps in several layouts.
"""

from __future__ import annotations

import copy

PROBE_DEPTHS = (1, 2)  # consecutive: the extension is low + (depth - d) x (high - low)


class LayoutConfigs:
    """The user's overrides composed once; `load(settings)` is that config with `settings` set
    ({"parallel.tp": 2, ...}), equal to load_config(overrides + ["parallel.tp=2", ...])."""

    def __init__(self, overrides: list[str], vocab: int | None = None):
        from omegaconf import OmegaConf

        from utils.cli.config import compose_config

        composed = compose_config(overrides)
        self.choices = OmegaConf.to_container(composed.hydra.runtime.choices)
        del composed.hydra
        self.job, self.overrides = composed, list(overrides)
        self.vocab = vocab  # a language model's vocabulary without data (--vocab); None: the task's default

    def load(self, settings: dict[str, int]):
        from omegaconf import OmegaConf

        from utils.cli.config import typed_config

        job = copy.deepcopy(self.job)
        for key, value in settings.items():
            OmegaConf.update(job, key, value, merge=False)
        argv = self.overrides + [f"{key}={value}" for key, value in settings.items()]
        return typed_config(job, self.choices, argv)[0]


def extend(low, high, low_depth: int, depth: int):
    """The figure at `depth` on the line through (low_depth, low) and (low_depth + 1, high): ints, or
    dicts of ints by axis (an axis one probe lacks counts 0 there; the order is the deeper probe's)."""
    if isinstance(low, dict):
        return {k: extend(low.get(k, 0), high.get(k, 0), low_depth, depth) for k in {**high, **low}}
    return low + (depth - low_depth) * (high - low)


def serial_params(configs: LayoutConfigs, depth: int) -> int:
    """Parameters of the serial model at `depth`, built on the meta device (no memory, no init)."""
    import torch

    cfg = configs.load({"model.depth": depth})
    with torch.device("meta"):
        model = data_less_task(cfg, configs.vocab).build_model()
    return sum(p.numel() for p in model.parameters())


def data_less_task(cfg, vocab: int | None):
    """cfg's task without its data (the planner reads none), a language model's vocabulary set to `vocab`
    (the tokenizer's; None: GPT-2's 50257)."""
    from utils import require
    from utils.tasks import build_task

    task = build_task(cfg, load_data=False)
    if vocab is not None:
        require(hasattr(task, "data_less_vocab"), f"model={cfg.model.arch} reads no vocabulary", "--vocab",
                "leave --vocab out")
        task.data_less_vocab = vocab
    return task


def probe_depths(configs: LayoutConfigs, depth: int) -> tuple[int, ...]:
    """The depths to take the step at: PROBE_DEPTHS when the configured depth lies beyond them and the
    serial parameter count is affine in the depth through them, else the configured depth itself."""
    low, high = PROBE_DEPTHS
    if depth <= high:
        return (depth,)
    counts = [serial_params(configs, d) for d in (low, high, depth)]
    return PROBE_DEPTHS if extend(counts[0], counts[1], low, depth) == counts[2] else (depth,)
