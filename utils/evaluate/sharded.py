"""The model of `python -m utils.evaluate` on the ranks of a launch (torchrun, Slurm): tensor and pipeline
parallel, built as training builds it.

The source's model settings (a run's config.yaml or a Hugging Face config.json) go into the configuration of
the default run of their family with `parallel.tp` and `parallel.pp` set (tp x pp = the launch's ranks); the
grid, this rank's stages and shards (utils/engine/build.py `build_model`: meta-built, cut, parallelized,
materialized) and its pieces of the weights (`load_model_weights`: a checkpoint of any layout resharded by DCP,
a Hugging Face folder read by slices) are the training run's. No rank ever holds the whole model.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from utils import require
from utils.comm import Grid
from utils.launch_env import launch_env


def ranks_of_launch() -> int:
    """The ranks this process is one of (1 without a launcher)."""
    return launch_env().world_size


def sharded_model(described, source, *, tp: int, pp: int, sequence_parallel: bool | None = None
                  ) -> tuple[nn.Module, Grid]:
    """(the model to call: this rank's shards, or the forward pass through the pipeline's stages; the grid).
    `sequence_parallel`: as training resolves it when None (on with GPUs); False for generation, whose
    one-token steps cannot be split over tp."""
    from utils.cli.config import load_config
    from utils.comm import check_grid, init_grid
    from utils.engine.build import build_model, load_model_weights
    from utils.tasks import build_task, check_pairing
    from utils.tasks.registry import spec_of

    world = ranks_of_launch()
    require(tp * pp == world, f"--tp {tp} x --pp {pp} is not the launch's {world} ranks", "--tp",
            f"give --tp and --pp whose product is {world}")
    tiny = spec_of(described.cfg.arch).tiny  # a config to set the source's model on
    sp = [] if sequence_parallel is None else [f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
    base, _, _ = load_config([f"model={tiny}", "data=wikitext_sample", f"parallel.tp={tp}",
                              f"parallel.pp={pp}", "parallel.dp=1", f"trainer.global_batch_size={pp}", *sp])
    data = dataclasses.replace(base.data, seq_len=described.cfg.max_positions, sample_tokens=0)
    cfg = dataclasses.replace(base, model=described.cfg, data=data)  # the source's model, checked again
    check_pairing(cfg)
    grid = init_grid(cfg.parallel, check_grid(cfg.parallel))
    task = build_task(cfg, load_data=False)
    task.data_less_vocab = described.vocab  # the vocabulary without a corpus: the source's
    built = build_model(cfg, task, grid)
    load_model_weights(built.raw, source, model_cfg=cfg.model, task=task, grid=grid)
    model = built.forward if built.forward is not None else built.raw
    model.eval()
    return model, grid
