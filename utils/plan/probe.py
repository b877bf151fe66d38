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
arithmetic: the same numbers as a full-depth step. Under pipeline parallelism a rank holds its stages'
blocks, not the model's: with one stage per rank the probes are 2 and 3 blocks per stage (`probe_stride`)
and the line is extended to the configured blocks per stage. Before it does, the serial model's parameter count,
built on the meta device at the two probe depths and at the full one, must lie on the same line (a model
with blocks of different shapes is measured at full depth instead). tests/test_plan.py checks the
extended figures against full-depth steps in several layouts.
"""

from __future__ import annotations

import copy

PROBE_DEPTHS = (1, 2)  # consecutive: the extension is low + (depth - d) x (high - low)
# Blocks per stage of the probes under pp: with one block, a stage under FSDP sends 0.4 MB less than the line
# through 2, 3 and 4 blocks gives (gpt_tiny pp2 x dp2, rank 0; measured 2026-11-28), the line starts at 2
PIPELINE_PROBE_BLOCKS = (2, 3)


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
        from utils.plan.workload import resolve_vocab

        # a language model's vocabulary without data, and where it comes from (--vocab V, the data's tokenizer,
        # the model preset's published one: utils/plan/workload.py); None for a model that reads none
        self.vocab, self.vocab_from = resolve_vocab(self.load({}), self.choices.get("model"), vocab)

    def load(self, settings: dict[str, int]):
        from omegaconf import OmegaConf

        from utils.cli.config import typed_config

        job = copy.deepcopy(self.job)
        for key, value in settings.items():
            OmegaConf.update(job, key, value, merge=False)
        argv = self.overrides + [f"{key}={value}" for key, value in settings.items()]
        return typed_config(job, self.choices, argv)[0]


def extend(low, high, low_depth: int, depth: int, stride: int = 1):
    """The figure at `depth` on the line through (low_depth, low) and (low_depth + stride, high): ints, or
    dicts of ints by axis (an axis one probe lacks counts 0 there; the order is the deeper probe's).
    `depth - low_depth` is a multiple of `stride`."""
    if isinstance(low, dict):
        return {k: extend(low.get(k, 0), high.get(k, 0), low_depth, depth, stride) for k in {**high, **low}}
    return low + (depth - low_depth) // stride * (high - low)


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


def probe_stride(cfg) -> int:
    """Blocks between the two probe depths: 1; under pipeline parallelism with one stage per rank, the
    stage count (every stage, so every rank, gains one block: PIPELINE_PROBE_BLOCKS per stage);
    0, no probes, with several stages per rank: the microbatches a rank has in flight then mix stages
    whose saved bytes grow differently with the depth (the embedding's, the head's), so the peak of the
    schedule need not be affine in it."""
    from utils.tasks import pipeline_plan

    if cfg.parallel.pp == 1:
        return 1
    plan = pipeline_plan(cfg)
    return plan.num_stages if plan.style == "single" else 0


def probe_depths(configs: LayoutConfigs, depth: int, stride: int = 1) -> tuple[int, ...]:
    """The depths to take the step at: PROBE_DEPTHS (under pp: PIPELINE_PROBE_BLOCKS times `stride`, the
    stage count, `probe_stride`) when the configured depth lies beyond them, is a multiple of the stride and
    the serial parameter count is affine in the depth through them, else the configured depth itself."""
    if not stride:
        return (depth,)
    low, high = PROBE_DEPTHS if stride == 1 else (d * stride for d in PIPELINE_PROBE_BLOCKS)
    if depth <= high or depth % stride:
        return (depth,)
    counts = [serial_params(configs, d) for d in (low, high, depth)]
    return (low, high) if extend(counts[0], counts[1], low, depth, stride) == counts[2] else (depth,)
