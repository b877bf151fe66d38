"""Setup in a few build_* steps, in the order data flows: grid -> model -> data -> trainer.

`build_run` is what train.py does: check everything against the launch and the data, build the grid,
then `build_trainer` (model, optimizer, schedule, scaler, checkpointer) and `start_run` (restore a
checkpoint, attach the data loaders from its step). The benchmark (utils/bench/train_step.py) uses `build_trainer`
as is, with random batches instead of loaders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from distributed.block_wrappers import wrap_blocks
from distributed.context.parallelize import parallelize_context
from distributed.data_parallel import local, wrap_data_parallel
from distributed.fsdp import param_groups, root_over_stage, shard_data_parallel
from distributed.pipeline.schedule import Pipeline, PipelineForward
from distributed.pipeline.stage_plan import PipelinePlan
from distributed.pipeline.stages import cut_for_rank
from distributed.placement import local_pieces
from distributed.rng import seed_default_stream
from distributed.tensor.parallelize import parallelize, sequence_parallel_notice, sequence_parallel_on
from utils import require
from utils.checkpoints import hf
from utils.checkpoints.checkpointer import Checkpointer, names_own_step, resume_state
from utils.checkpoints.hf_stream import read_pieces
from utils.checkpoints.run_dir import (
    check_resumable,
    flat_config,
    prepare_run_dir,
    resolve_step,
    run_dir_for,
    write_layout,
    write_task,
)
from utils.checkpoints.sharded_state import checkpoint_view, load_state, read_shapes
from utils.comm import Axis, Grid, background_group, batch_parts, check_grid, init_grid, layout_name, parse_order
from utils.data.batching import build_loaders, check_batch
from utils.engine.flops import mfu_absence, training_flops_per_sample
from utils.engine.logger import hparam_values, setup_logging
from utils.engine.materialize import materialize
from utils.engine.memory import fix_mmap_threshold, reset_host_peak
from utils.engine.optim import build_optimizer, build_scheduler
from utils.engine.precision import autocast, configure_matmul, grad_scaler, precision_notice
from utils.engine.preemption import StopRequest
from utils.engine.trainer import Trainer
from utils.launch_env import restart_warning
from utils.schema import Config
from utils.tasks import Task, build_task, pipeline_plan
from utils.tasks.registry import spec_of


@dataclass
class BuiltModel:
    model: nn.Module  # what the loop calls: DDP-wrapped when there are data-parallel replicas
    raw: nn.Module  # the (parallelized) module underneath: state dicts, criterion, parameters
    flops_per_sample: float  # training FLOPs of one sample of the full (unsharded) model
    pipeline: Pipeline | None = None  # pp > 1: the schedule over this rank's stages (raw holds their parts)
    forward: PipelineForward | None = None  # pp > 1: the forward-only pass through every stage


def build_model(cfg: Config, task: Task, grid: Grid, *, values: bool = True) -> BuiltModel:
    """This rank's stages and shards of the model, never the whole model (utils/engine/materialize.py).

    The serial model is built on the meta device (shapes, ties, no memory), cut for this pipeline rank,
    parallelized over tp and cp and sharded by FSDP there; then this rank allocates only what it holds on
    grid.device and computes its values from `trainer.seed` and each parameter's name (the same full
    weights under every layout). values=False (the planner): allocated without values. Every shape,
    dtype, tie and collective is the real model's either way."""
    with torch.device("meta"):
        model = task.build_model()  # the serial model's shapes: no memory, no values
    rules = model.init_rules() if values else None
    flops = flops_per_sample(cfg, task, model)  # before sharding
    plan = pipeline_plan(cfg) if grid.size(Axis.PP) > 1 else None
    if plan is not None:
        model = cut_for_rank(model, plan, grid.rank(Axis.PP))
    sequence_parallel = sequence_parallel_on(cfg.parallel.sequence_parallel, grid.device)
    model = parallelize(model, grid=grid, sequence_parallel=sequence_parallel,
                        keep_gathered=cfg.parallel.sp_keep_gathered)
    model = parallelize_context(model, grid=grid, variant=cfg.parallel.cp_attention)
    if cfg.trainer.activation_checkpointing or cfg.precision.compile:
        wrap_blocks(model, checkpoint=cfg.trainer.activation_checkpointing, compile=cfg.precision.compile)
    if cfg.parallel.dp_mode == "fsdp":
        model = shard_data_parallel(model, grid=grid, pipeline=plan is not None,
                                    reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward)
    materialize(model, grid.device, rules=rules, seed=cfg.trainer.seed)
    # The stream dropout draws from: fixed by the seed after setup, distinct per data-parallel replica and
    # pipeline rank. Tensor-parallel ranks share it; dropouts on tp-sharded activations fork a stream per
    # shard from it (distributed/rng.py).
    seed_default_stream(cfg.trainer.seed, grid)
    if plan is None:
        wrapped = model if cfg.parallel.dp_mode == "fsdp" else wrap_data_parallel(model, grid=grid)
        return BuiltModel(wrapped, model, flops)
    return BuiltModel(model, model, flops, *build_pipeline(cfg, task, grid, model, plan))


def flops_per_sample(cfg: Config, task: Task, model: nn.Module) -> float:
    """Training FLOPs of one sample of the full serial `model` (any device, meta included)."""
    layers, width, causal = model.attention_layers()  # the family's (networks/spec.py)
    return training_flops_per_sample(task.tokens_per_sample(), model.matmul_params(), layers, width, causal)


def build_pipeline(cfg: Config, task: Task, grid: Grid, model: nn.Module, plan: PipelinePlan):
    """(Pipeline, PipelineForward) over this rank's stages of the cut `model`, with static shapes."""
    from distributed.pipeline.torch_stages import build_stages  # torch.distributed.pipelining: pp runs only

    parts = grid.batch.size * cfg.trainer.grad_accum_steps * plan.microbatches
    example = task.example_batch(cfg.trainer.global_batch_size // parts, torch.device("meta"))[0]
    mode = cfg.precision.mode
    out_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32)
    stages = build_stages(model, plan, axis=grid.axis(Axis.PP), example=example, length=task.tokens_per_sample(),
                          out_dtype=out_dtype, autocast=partial(autocast, mode, grid.device),
                          reduce_every_microbatch=cfg.parallel.fsdp_reduce_every_microbatch)
    for stage in stages:  # FSDP: one root over each stage's blocks (else none is applied)
        root_over_stage(stage.submod.blocks, grid=grid)
    return Pipeline(model, stages, plan, grid), PipelineForward(model, [s.submod for s in stages], plan, grid)


def param_bytes_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Parameter, gradient (same as parameters) and optimizer-state bytes held by this rank."""
    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state = sum(local(t).numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    state = state or 2 * params  # Adam's two moments, allocated at the first step
    n = sum(local(p).numel() for p in model.parameters())
    return (f"this rank holds {n / 1e6:.2f}M parameters: {params / 2**20:.1f} MiB weights, "
            f"{params / 2**20:.1f} MiB gradients, {state / 2**20:.1f} MiB optimizer state")


def resume_run_dir(resume: str, run_dir: Path) -> Path | None:
    """The run directory whose settings a resume continues: this run's (auto, a step number or a step_*
    name), or the one holding a checkpoint PATH (<run>/checkpoints/step_*)."""
    if resume == "never":
        return None
    if resume == "auto" or names_own_step(resume):
        return run_dir
    parents = Path(resume).expanduser().resolve().parents
    return parents[1] if len(parents) > 1 else None


def build_run(cfg: Config, choices: dict[str, str], config_yaml: str, digest: str) -> Trainer:
    """Everything train.py does before fitting: validate against the data and the launch, then build. `digest`
    names the settings overridden beyond the presets in a default run directory (utils/cli/runs.py `run_digest`).

    Stop signals are recorded from the first line on (a notice ahead of a time limit can arrive during a
    long checkpoint load or data preparation); the trainer's `fit` acts on them before its first step."""
    request = StopRequest(cfg.trainer.preempt_deadline_s).__enter__()
    fix_mmap_threshold(cfg.trainer.malloc_mmap_threshold_mib)  # freed blocks go back (utils/engine/memory.py)
    reset_host_peak()  # the run's own high-water mark (utils/engine/memory.py)
    try:
        sizes = check_grid(cfg.parallel)  # the one resolution of the axis sizes for this launch
        task = build_task(cfg)  # inspects the data: every data error is raised before distributed work
        microbatches = pipeline_plan(cfg).microbatches if sizes[Axis.PP] > 1 else 1
        check_batch(cfg.trainer.global_batch_size, batch_parts(sizes), cfg.trainer.grad_accum_steps,
                    len(task.train_set), microbatches)
        run_dir = run_dir_for(cfg, choices, layout_name(sizes, parse_order(cfg.parallel.order)), digest)
        previous = resume_run_dir(cfg.trainer.resume, run_dir)
        if previous is not None:
            check_resumable(previous, config_yaml, choices)
        if cfg.trainer.init_from:
            check_init_from(Path(cfg.trainer.init_from), cfg, task)
        prepare_run_dir(run_dir)
        grid = init_grid(cfg.parallel, sizes)
        log = setup_logging(run_dir, grid.is_main)
        if (warning := restart_warning()) is not None:
            log.warning(warning)
        trainer = build_trainer(cfg, task, grid, log, run_dir)
        start_run(trainer, config_yaml)
    except BaseException:
        request.__exit__(None, None, None)  # the caller's handlers back (an in-process caller, a sweep)
        raise
    trainer.stop_request = request
    return trainer


def init_source(folder: Path) -> Path:
    """What trainer.init_from names: a Hugging Face model folder (config.json) as it is, else the complete step
    folder of a run directory, its checkpoints/, checkpoints/latest or a step folder (run_dir.py `resolve_step`:
    the newest complete step); ConfigError naming the complete steps there are for anything else."""
    if (folder / "config.json").is_file():
        return folder
    return resolve_step(folder, "trainer.init_from", also="a Hugging Face model folder")


def check_init_from(folder: Path, cfg: Config, task: Task) -> None:
    """A complete checkpoint (`init_source`), or a Hugging Face folder of the configured language model (its
    config.json checked against model.* and the tokenizer's vocabulary, before any work)."""
    if (init_source(folder) / "config.json").is_file():
        require(spec_of(cfg.model.arch).hf is not None, f"{folder} is a Hugging Face folder, and model="
                f"{cfg.model.arch} exchanges no weights with Hugging Face", "trainer.init_from",
                "give a checkpoint of a run of this model")
        hf.check_folder(folder, cfg.model, task.vocab_size)


def init_weights_from(trainer: Trainer, folder: Path) -> None:
    """Fine-tuning: this rank's model weights from a checkpoint of any layout or a Hugging Face folder."""
    source = init_source(folder)
    load_model_weights(trainer.raw_model, source, model_cfg=trainer.cfg.model, task=trainer.task, grid=trainer.grid)
    given = "" if source == folder else f"={folder}"
    trainer.log.info(f"model weights from {source} (trainer.init_from{given}); optimizer, schedule and step start "
                     "afresh")


def load_model_weights(raw: nn.Module, folder: Path, *, model_cfg, task: Task, grid: Grid) -> None:
    """This rank's pieces of `raw` (built by build_model under any layout) from a checkpoint of any layout
    (resharded by DCP, as a resume), or from a Hugging Face folder (each rank reads only the rows and columns
    of the pieces it holds: utils/checkpoints/hf_stream.py). Fine-tuning and `python -m utils.evaluate`."""
    if (folder / "config.json").is_file():
        for module in raw.modules():  # FSDP's sharded parameters, the pieces local_pieces describes
            if isinstance(module, FSDPModule):
                module.reshard()
        read_pieces(folder, model_cfg, task.vocab_size, local_pieces(raw))
        return
    view = checkpoint_view(raw, None, grid, for_load=True)
    with torch.device("meta"):  # the whole model's names and shapes (a pipeline rank's view holds its stages')
        serial = task.build_model()
    wanted = {f"model/{k}": tuple(t.shape) for k, t in serial.state_dict().items()}
    held = {k: s for k, s in read_shapes(folder).items() if k.startswith("model/")}
    wrong = sorted(k for k in wanted.keys() | held.keys() if wanted.get(k) != held.get(k))
    require(not wrong, f"{folder} holds another model ({len(wrong)} weights missing, extra or of other shapes, "
            f"e.g. {wrong[0] if wrong else ''})", "trainer.init_from",
            "give a checkpoint of a run of the same model")
    load_state(view.tensors, folder, grid.world)


def build_trainer(cfg: Config, task: Task, grid: Grid, log: logging.Logger, run_dir: Path, *,
                  values: bool = True) -> Trainer:
    """Model, optimizer, schedule, scaler and checkpointer: a trainer that can take steps (no data yet).
    values=False: weights without values (build_model), for the planner's shapes-only step."""
    configure_matmul(cfg.precision.mode)
    built = build_model(cfg, task, grid, values=values)
    optimizer = build_optimizer(cfg.optim, param_groups(built.raw))
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.trainer.max_steps)
    scaler = grad_scaler(cfg.precision.mode, grid.device, grid.world)
    background = background_group(grid) if cfg.trainer.ckpt_async else None
    checkpointer = Checkpointer(run_dir, grid.world, cfg.trainer.ckpt_keep, background)
    trainer = Trainer(cfg=cfg, grid=grid, task=task, built=built, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, checkpointer=checkpointer, run_dir=run_dir, log=log)
    trainer.memory.mark("build")
    return trainer


def start_run(trainer: Trainer, config_yaml: str) -> None:
    """Restore the checkpoint to resume from (if any), attach the loaders from its step, log the setup."""
    cfg, grid, task, log = trainer.cfg, trainer.grid, trainer.task, trainer.log
    batch = grid.batch
    state = resume_state(cfg.trainer.resume, trainer.checkpointer, trainer.checkpoint_destination, grid.device, log)
    if state is not None:
        trainer.restore(*state)
    elif cfg.trainer.init_from:
        init_weights_from(trainer, Path(cfg.trainer.init_from))
    if state is not None or cfg.trainer.init_from:
        trainer.memory.mark("load")
    trainer.loaders = build_loaders(task.train_set, task.val_set, global_batch_size=cfg.trainer.global_batch_size,
                                    dp_rank=batch.rank, dp_size=batch.size, seed=cfg.trainer.seed,
                                    start_step=trainer.step, num_workers=cfg.trainer.num_workers,
                                    worker_start=cfg.trainer.worker_start,
                                    pin_memory=grid.device.type == "cuda",
                                    even_val_batches=cfg.parallel.dp_mode == "fsdp",
                                    read_train=grid.same_batch.rank == 0)  # see SharedBatches
    if grid.is_main:
        (trainer.run_dir / "config.yaml").write_text(config_yaml)
        write_layout(trainer.run_dir, grid)  # run facts as data (utils/checkpoints/run_dir.py), read by tools and tests
        write_task(trainer.run_dir, cfg, task)
    notes = [note] if (note := mfu_absence(grid.device, cfg.precision.mode)) is not None else []
    if trainer.step < cfg.trainer.max_steps:  # a finished run's directory gets no new events
        metrics = ["train/loss", "val/loss", task.quality_metric, "perf/samples_per_sec", "perf/tokens_per_sec"]
        trainer.tb.run_header(config_yaml, hparam_values(flat_config(config_yaml)), metrics, notes, trainer.step)
    log.info(f"grid: {grid.signature}; run.dir: {trainer.run_dir}")
    if trainer.pipeline is not None:
        plan = trainer.pipeline.plan
        log.info(f"pipeline: {plan.schedule}, {plan.num_stages} stages ({plan.stages_per_rank} per rank), "
                 f"{plan.microbatches} microbatches per step, {plan.bubble_text()}\n"
                 + "\n".join(plan.describe()))
    log.info(param_bytes_report(trainer.raw_model, trainer.optimizer))
    if (notice := precision_notice(cfg.precision.mode, grid.device)) is not None:
        log.warning(notice)
    for note in notes if trainer.step == 0 else ():  # once, at a run's start (TensorBoard keeps it)
        log.info(note)
    if grid.size(Axis.TP) > 1 and (note := sequence_parallel_notice(cfg.parallel.sequence_parallel, grid.device)):
        log.info(note)
    if cfg.precision.compile and grid.size(Axis.CP) > 1 and cfg.parallel.cp_attention in ("ring", "hierarchical"):
        log.info(f"precision.compile with parallel.cp_attention={cfg.parallel.cp_attention}: each block compiles "
                 "around its ring attention, "
                 "which runs eagerly (its point-to-point hops are not traceable): one graph break per attention "
                 "layer; parallel.cp_attention=alltoall or allgather compile into one graph per block")
    share = grid.same_batch
    log.info(f"data: {task.describe()}" + (f"; training batches read by one rank of each tp x cp group of "
                                            f"{share.size} and broadcast to the others" if share.size > 1 else ""))
