"""Setup in a few build_* steps, in the order data flows: grid -> model -> data -> trainer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from utils.comm import Axis, Grid, check_grid, init_grid, parse_order
from utils.config import Config
from utils.data import build_loaders, check_batch
from utils.errors import require
from utils.logger import setup_logging
from utils.optim import build_optimizer, build_scheduler
from utils.precision import configure_matmul, grad_scaler
from utils.runs import check_resumable, layout_name, run_dir_for
from utils.tasks import build_task
from utils.trainer import Trainer


@dataclass
class BuiltModel:
    model: nn.Module  # what the loop calls: DDP-wrapped when there are data-parallel replicas
    raw: nn.Module  # the (parallelized) module underneath: state dicts, criterion, parameters
    flops_per_sample: float  # training FLOPs of one sample of the full (unsharded) model


def build_model(cfg: Config, task, grid: Grid) -> BuiltModel:
    """Full weights from the seed (identical on every rank and layout), then this rank's shards."""
    torch.manual_seed(cfg.trainer.seed)
    model = task.build_model()  # full serial weights on CPU
    flops = task.flops_per_sample(model.matmul_params())  # counted before sharding
    if grid.size(Axis.TP) > 1:
        from distributed.parallelize import parallelize

        model = parallelize(model, grid=grid, sequence_parallel=cfg.parallel.sequence_parallel)
    model.to(grid.device)
    if cfg.trainer.activation_checkpointing or cfg.precision.compile:
        from distributed.block_wrappers import wrap_blocks

        wrap_blocks(model, checkpoint=cfg.trainer.activation_checkpointing, compile=cfg.precision.compile)
    # The stream dropout draws from: fixed by the seed after setup (which draws differently per layout),
    # distinct per data-parallel replica. Tensor-parallel ranks share it (no Megatron RNG tracker yet).
    torch.manual_seed(cfg.trainer.seed * 1_000_003 + 1 + grid.rank(Axis.DP))
    if grid.world_size > 1:
        from distributed.data_parallel import wrap_data_parallel

        return BuiltModel(wrap_data_parallel(model, grid=grid), model, flops)
    return BuiltModel(model, model, flops)


def param_bytes_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Parameter, gradient (same as parameters) and optimizer-state bytes held by this rank."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    state = state or 2 * params  # Adam's two moments, allocated at the first step
    n = sum(p.numel() for p in model.parameters())
    return (f"this rank holds {n / 1e6:.2f}M parameters: {params / 2**20:.1f} MiB weights, "
            f"{params / 2**20:.1f} MiB gradients, {state / 2**20:.1f} MiB optimizer state")


def check_supported(cfg: Config, sizes: dict[Axis, int]) -> None:
    """Layouts this version cannot train yet, and model shapes the layout cannot split (before any work)."""
    for axis, name in ((Axis.CP, "context"), (Axis.PP, "pipeline")):
        require(sizes[axis] == 1, f"{name} parallelism is not implemented yet", f"parallel.{axis.value}",
                f"set parallel.{axis.value}=1 (tensor and data parallelism are available)")
    tp = sizes[Axis.TP]
    require(cfg.model.num_heads % tp == 0, f"num_heads {cfg.model.num_heads} is not divisible by tp={tp}",
            "parallel.tp", "choose a tp that divides model.num_heads")


def build_run(cfg: Config, choices: dict[str, str], config_yaml: str) -> Trainer:
    """Everything train.py does before fitting: validate against the data and the launch, then build."""
    sizes = check_grid(cfg.parallel)
    check_supported(cfg, sizes)
    task = build_task(cfg)  # inspects the data: every data error is raised before distributed work
    check_batch(cfg.trainer.global_batch_size, sizes[Axis.DP], cfg.trainer.grad_accum_steps, len(task.train_set))
    layout = layout_name(sizes, parse_order(cfg.parallel.order))
    run_dir = run_dir_for(cfg, choices, config_yaml, layout)
    if cfg.trainer.resume != "never":
        check_resumable(Path(cfg.trainer.resume).parents[1] if cfg.trainer.resume != "auto" else run_dir, config_yaml)
    grid = init_grid(cfg.parallel)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging(run_dir, grid.is_main)
    return build_trainer(cfg, choices, config_yaml, task, grid, log, run_dir)


def build_trainer(cfg: Config, choices: dict[str, str], config_yaml: str, task, grid: Grid,
                  log: logging.Logger, run_dir: Path) -> Trainer:
    """Model, optimizer, schedule, scaler, loaders and the restored state of a resumed run."""
    from utils.checkpoint import Checkpointer, resolve_resume

    configure_matmul(cfg.precision.mode)
    dp = grid.axis(Axis.DP)
    built = build_model(cfg, task, grid)
    raw = built.raw
    optimizer = build_optimizer(cfg.optim, raw.parameters(), grid.device)
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.trainer.max_steps)
    scaler = grad_scaler(cfg.precision.mode, grid.device)
    checkpointer = Checkpointer(run_dir, grid.global_rank, cfg.trainer.ckpt_keep, grid.describe().splitlines()[0])
    resume = resolve_resume(cfg.trainer.resume, checkpointer)
    trainer_args = dict(cfg=cfg, grid=grid, task=task, built=built, optimizer=optimizer, scheduler=scheduler,
                        scaler=scaler, checkpointer=checkpointer, run_dir=run_dir, log=log)
    state = checkpointer.load(resume, replica_source=dp.ranks[0]) if resume else None
    start = int(state["step"]) if state else 0
    loaders = build_loaders(task.train_set, task.val_set, global_batch_size=cfg.trainer.global_batch_size,
                            dp_rank=dp.rank, dp_size=dp.size, seed=cfg.trainer.seed, start_step=start,
                            num_workers=cfg.trainer.num_workers, pin_memory=grid.device.type == "cuda")
    trainer = Trainer(loaders=loaders, start_step=start, **trainer_args)
    if state:
        trainer.load_state(state)
        log.info(f"resumed from {resume} at step {start}")
    if grid.is_main:
        (run_dir / "config.yaml").write_text(config_yaml)
    log.info(f"grid: {grid.describe().splitlines()[0]}; run.dir: {run_dir}")
    log.info(param_bytes_report(raw, optimizer))
    log.info(f"data: {task.describe()}")
    return trainer

