"""Plan a layout before launching it: `python -m utils.plan [overrides] [gpu=h100|a100|cpu] [options]`.

Prints, for global rank 0 of a layout (under pp the rank of rank 0's pipeline that holds the most), or with
--world N for every tp x cp x dp layout of N ranks,
the bytes it holds (parameters, gradients, Adam state, activations saved for backward; under FSDP its
shards of the first three and the units gathered at the peak), the bytes it sends per training step on
each grid axis, and a predicted step time, ranked by that time.

    python -m utils.plan model=vit_large data=era5 precision=bf16 gpu=h100 --world 8
    python -m utils.plan parallel=tp2 parallel.dp=2 gpu=cpu --json
    python -m utils.plan model=llama_8b data=wikitext parallel.dp=32 parallel.dp_mode=fsdp trainer.global_batch_size=64

The second header line says what the plan assumes of the run and where each figure comes from
(utils/plan/workload.py): a language model's vocabulary (--vocab V; else the data's tokenizer where it can be
read without the corpus; else the model preset's published one, Llama 3's 128256 for llama_1b and llama_8b,
GPT-2's 50257 for gpt_small and gpt_medium; else GPT-2's), the global batch (trainer.global_batch_size; with
--world N and neither that override nor an experiment= preset setting it, N x the one-process default of 16)
and the tokens per sample (data.seq_len; the ViT's patches). A layout that does not fit gets a hint: its
largest part and the settings that shrink it. A --world search prints its progress on stderr.

Nothing is computed from a second copy of the formulas: the planner builds the real trainer
(utils.engine.build.build_trainer) on one process under torch's fake process group (collectives do nothing,
the counted ones in distributed/ still record their bytes) and takes one real Trainer.train_step under
a fake-tensor mode (shapes and dtypes, no values, no FLOPs). The comm figures are the comm/<axis>_bytes a
real run logs; the activation figure is utils.bench.train_step.saved_for_backward_bytes; parameter, gradient and
optimizer bytes are counted as utils.engine.build.param_bytes_report does (Adam's two moments; its 4-byte step
counts are left out as there). Rank 0 holds the largest shard of an uneven tp split. FSDP
(parallel.dp_mode=fsdp, utils/plan/fsdp.py): FSDP2's all-gathers and reduce-scatters are torch's own, not
in comm/<axis>_bytes; the planner counts them from the step's own collective calls on the sharded weights
and adds them to the axis FSDP shards over (dp, or cp_dp), and models the gathered units' peak from their
sizes (FSDP's gathered weights are weights, not saved activations). Without the wait:
the weights are built on the meta device and allocated without values, the step is taken at depths 1 and 2
and every figure extended to the configured depth, exactly (utils/plan/probe.py says why), and --world plans
its layouts in forked workers.

Options (defaults by gpu: h100 | a100 | cpu):
  gpu=NAME            h100 (default) | a100 | cpu
  --world N           plan every layout of N ranks (tp x cp x dp, pp=1) the config checks accept, at a global
                      batch of N x 16 unless trainer.global_batch_size=B (or an experiment=) sets one
  --jobs N            with --world: layouts planned at once, in forked processes (default: one per CPU core)
  --json              print JSON: per layout comm_bytes {axis: bytes per step}, param_bytes, grad_bytes,
                      optimizer_bytes, activation_bytes, gathered_bytes (FSDP), host_bytes (rank 0),
                      step_time_s, compute_s, bubble_s, comm_s, fits, rank
  --vocab V           a language model's vocabulary (the planner reads no corpus): default as the header says
  --efficiency X      achieved fraction of the dense peak (utils.engine.flops.PEAK_TFLOPS): 0.5
  --peak-tflops X     dense peak per device for the run's precision: h100/a100 from the table; cpu 0.2
  --intra-gbs X       GB/s per direction inside a node: NVLink 450 (h100) | 300 (a100); cpu loopback 5
  --inter-gbs X       GB/s per GPU between nodes: InfiniBand 50 (400 Gb/s NDR); cpu 5
  --bandwidths FILE   the doctor's measured links (JSON, kind dlscale-bandwidths, version 1): its intra_gbs
                      and inter_gbs replace the preset's (null keeps it); --intra-gbs / --inter-gbs still win
  --pcie              nodes without NVLink: intra-node links at PCIe Gen4 x16, 25 GB/s
  --gpus-per-node N   8 (cpu: 1000, one node)
  --memory-gb X       memory per device: 80 (cpu: 1000)

Model: step time = compute + sum over axes of bytes / link bandwidth, no overlap of communication with
compute assumed (an upper bound for DDP, which overlaps its bucket all-reduces with backward). Compute =
training FLOPs of the rank's share of the global batch (utils.engine.flops.training_flops_per_sample) / (peak x
efficiency). An axis is intra-node when rank 0's group on it lies in one node (parallel.order decides).
Fits = parameters + gradients + Adam state + saved activations + FSDP's gathered units <= memory (no
allocator slack, workspace or bf16 weight copies); without dp replicas or accumulation the gradients and the
activations never meet (`LayoutPlan.total_bytes`): the larger of the two is counted. Host: the runtime
(HOST_RUNTIME_GIB) plus, on a CPU, that total.

Pipeline parallelism (parallel.pp > 1, any schedule, FSDP or not): the planned step is the real schedule's
(torch's pipelining with the stages' static shapes: its start-up vote on them reads as a fake tensor's 1, the
static mode a real run agrees on), so the saved bytes are those of the microbatches the schedule has in flight
at its peak and the pp figure is the activations and gradients the rank sends. Every pp rank of rank 0's
pipeline is planned (the first stage holds the embedding and the most microbatches in flight, the last the
head) and the one with the largest total shown, named. Step time adds the schedule's bubble in theory
(distributed/pipeline/stage_plan.py): compute x bubble / (1 - bubble), none for the zero-bubble schedules;
the imbalance of the stages is not modelled (compute is the rank's share of the model's FLOPs, 1/world).
--world plans pp = 1 layouts only: plan a pipeline with parallel.pp and its schedule's settings.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from dataclasses import asdict, dataclass, field
from functools import partial

from utils import ConfigError, tool_main
from utils.plan.fsdp import extend_units, gathered_peak
from utils.plan.options import Hardware, Request, parse_args
from utils.plan.probe import LayoutConfigs, extend, probe_depths, probe_stride
from utils.plan.report import collect, fit_hint, table
from utils.plan.step import Measured, measure_layout
from utils.plan.workload import workload

GB = 1e9


@dataclass
class LayoutPlan:
    """What one rank of a layout (rank 0, or `rank` under pp) holds and sends in one training step, and the
    predicted step time."""

    layout: str
    overrides: list[str]
    comm_bytes: dict[str, int] = field(default_factory=dict)  # axis -> bytes rank 0 sends per step
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0  # peak bytes saved for backward
    gathered_bytes: int = 0  # FSDP: peak bytes of gathered weights and their unsharded gradients (utils/plan/fsdp.py)
    compute_s: float = 0.0
    bubble_s: float = 0.0  # pp: the schedule's idle time, compute_s x bubble / (1 - bubble)
    comm_s: float = 0.0
    step_time_s: float = 0.0
    fits: bool = True
    refused: str = ""  # the one-line error of a layout the code refuses
    host_bytes: int = 0  # peak resident host memory of the rank: the runtime, plus everything above on a CPU
    grads_meet_activations: bool = True  # False: no dp replicas, accumulation or pipeline (see total_bytes)
    rank: int = 0  # the global rank planned: 0, or under pp the pp rank of rank 0's pipeline holding the most
    to_fit: str = ""  # a layout that does not fit: its largest part and what shrinks it (utils/plan/report.py)

    @property
    def total_bytes(self) -> int:
        """The step's peak: weights, Adam's state (alive from the second step on) and, when the gradients exist
        beside the saved activations (DDP's buckets hold them for the whole step, accumulation and a pipeline's
        microbatches keep the earlier micro-batches' gradients beside the later ones' activations; FSDP's shards
        are counted so too; an upper bound), both; else the larger: the
        step starts without gradients (`zero_grad(set_to_none=True)`) and its backward frees the activations as
        it makes them."""
        during = self.grad_bytes + self.activation_bytes if self.grads_meet_activations else \
            max(self.grad_bytes, self.activation_bytes)
        return self.param_bytes + self.optimizer_bytes + during + self.gathered_bytes


def peak_tflops(hw: Hardware, precision: str) -> float:
    from utils.engine.flops import PEAK_TFLOPS

    return PEAK_TFLOPS[hw.peak][precision] if isinstance(hw.peak, str) else float(hw.peak)


def link_gbs(hw: Hardware, ranks: list[int]) -> float:
    """Bandwidth of the link a group of global ranks crosses: intra-node when they share a node."""
    return hw.intra_gbs if len({r // hw.gpus_per_node for r in ranks}) == 1 else hw.inter_gbs


def world_of(cfg) -> int:
    """Ranks cfg's layout needs (as train_mp.py counts them), validated like a launch."""
    from utils.cli.launch import ranks_needed
    from utils.comm import check_grid
    from utils.launch_env import LaunchEnv

    world = ranks_needed(cfg.parallel)
    check_grid(cfg.parallel, LaunchEnv(world_size=world))
    return world


def plan_layout(overrides: list[str], hw: Hardware, world: int, *, values: bool = False,
                probe: bool = True, vocab: int | None = None, rank: int | None = None) -> LayoutPlan:
    """Plan the layout the overrides give, on `world` ranks (utils/plan/step.py: one shapes-only step of the
    real trainer; probe=False: at the configured depth, not extended from PROBE_DEPTHS; vocab: --vocab;
    rank: plan this global rank, not `plan_settings`' choice)."""
    configs = LayoutConfigs(overrides, vocab)
    return plan_settings(configs, {}, hw, world, configured_probes(configs) if probe else (), values=values,
                         rank=rank)


def configured_probes(configs: LayoutConfigs) -> tuple[int, ...]:
    """The probe depths of the composed config itself (utils/plan/probe.py)."""
    cfg = configs.load({})
    return probe_depths(configs, cfg.model.depth, probe_stride(cfg))


def plan_settings(configs: LayoutConfigs, settings: dict[str, int], hw: Hardware, world: int,
                  depths: tuple[int, ...] = (), *, values: bool = False, rank: int | None = None) -> LayoutPlan:
    """Plan configs.load(settings): measured at the configured depth, or at the two `depths` and extended
    to it (utils/plan/probe.py). Rank 0 is planned, or `rank`; under pipeline parallelism, without `rank`,
    every pp rank of rank 0's pipeline (their stages differ: the embedding, the head, the microbatches in
    flight) and the one holding the most is returned."""
    import torch

    from distributed.tensor.parallelize import sequence_parallel_on
    from utils.comm import Axis, parse_order, rank_layout, resolve_sizes

    overrides = configs.overrides + [f"{k}={v}" for k, v in settings.items()]
    cfg = configs.load(settings)
    if cfg.parallel.sequence_parallel is None:  # unset: as a run on the planned device resolves it, not this CPU
        settings = {**settings, "parallel.sequence_parallel": sequence_parallel_on(None, torch.device(hw.device))}
        cfg = configs.load(settings)
    sizes = resolve_sizes(cfg.parallel, world)
    ranks = rank_layout(sizes, parse_order(cfg.parallel.order))[Axis.PP][0] if sizes[Axis.PP] > 1 else [0]
    ranks = ranks if rank is None else [rank]
    plans = [plan_measured(cfg, measure_rank(configs, cfg, settings, world, depths, r, values), hw, world, overrides)
             for r in ranks]
    return max(plans, key=lambda p: p.total_bytes)


def measure_rank(configs: LayoutConfigs, cfg, settings: dict[str, int], world: int, depths: tuple[int, ...],
                 rank: int, values: bool) -> Measured:
    """Global rank `rank` of cfg = configs.load(settings), measured at its depth or at two probe depths and
    extended."""
    depth = cfg.model.depth
    if len(depths) < 2:
        return measure_layout(cfg, world, rank=rank, values=values, vocab=configs.vocab)
    low, high = (measure_layout(configs.load({**settings, "model.depth": d}), world, rank=rank, values=values,
                                vocab=configs.vocab) for d in depths)
    stride = depths[1] - depths[0]
    return Measured(high.layout, tuple(extend(a, b, depths[0], depth, stride) for a, b in zip(low.held, high.held)),
                    extend(low.comm_bytes, high.comm_bytes, depths[0], depth, stride),
                    extend(low.activation_bytes, high.activation_bytes, depths[0], depth, stride),
                    full_flops_per_sample(cfg, configs.vocab), high.axis_ranks,
                    extend_units(high.units, depth // stride), high.root_bytes, rank)


def plan_measured(cfg, full: Measured, hw: Hardware, world: int, overrides: list[str]) -> LayoutPlan:
    """The plan of one measured rank: its bytes, the step's compute (with the schedule's bubble under pp),
    its communication, whether it fits."""
    plan = LayoutPlan(full.layout, overrides, rank=full.rank)
    plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes = full.held
    plan.comm_bytes, plan.activation_bytes = full.comm_bytes, full.activation_bytes
    par = cfg.parallel
    plan.grads_meet_activations = par.dp * par.cp > 1 or cfg.trainer.grad_accum_steps > 1 or par.pp > 1
    if full.units or full.root_bytes:
        plan.gathered_bytes = gathered_peak(full.units, full.root_bytes, cfg.parallel.fsdp_reshard_after_forward,
                                            accumulating=microbatches_per_step(cfg) > 1
                                            and not cfg.parallel.fsdp_reduce_every_microbatch)
    flops = full.flops_per_sample * cfg.trainer.global_batch_size / world
    plan.compute_s = flops / (peak_tflops(hw, cfg.precision.mode) * 1e12 * hw.efficiency)
    bubble = pipeline_bubble(cfg)
    plan.bubble_s = plan.compute_s * bubble / (1 - bubble)
    plan.comm_s = sum(n / (link_gbs(hw, full.axis_ranks[name]) * GB) for name, n in plan.comm_bytes.items())
    plan.step_time_s = plan.compute_s + plan.bubble_s + plan.comm_s
    plan.fits = plan.total_bytes <= hw.memory_gb * GB
    plan.to_fit = "" if plan.fits else fit_hint(plan, cfg)
    plan.host_bytes = round(HOST_RUNTIME_GIB * 2**30) + (plan.total_bytes if hw.device == "cpu" else 0)
    return plan


def microbatches_per_step(cfg) -> int:
    """Backward passes in one optimizer step: grad_accum_steps, times the schedule's microbatches under pp."""
    from utils.tasks import pipeline_plan

    pp = pipeline_plan(cfg).microbatches if cfg.parallel.pp > 1 else 1
    return cfg.trainer.grad_accum_steps * pp


def pipeline_bubble(cfg) -> float:
    """The idle fraction of a step the pipeline schedule's theory predicts (distributed/pipeline/stage_plan.py);
    0 without pp and for the zero-bubble schedules."""
    from utils.tasks import pipeline_plan

    return (pipeline_plan(cfg).bubble() or 0.0) if cfg.parallel.pp > 1 else 0.0


# Peak resident memory of a rank beyond the model: Python, torch and its libraries, the data, gloo's buffers,
# measured as the one-process run of a one-block model (python -m utils.bench.memory's overhead row; CPU,
# torch 2.13, docs/measurements.md). On GPUs the CUDA runtime's host memory comes on top and is not modelled.
HOST_RUNTIME_GIB = 0.33


def full_flops_per_sample(cfg, vocab: int | None) -> float:
    """Training FLOPs of one sample of cfg's serial model at its configured depth, built on the meta device."""
    import torch

    from utils.engine.build import flops_per_sample
    from utils.plan.probe import data_less_task

    task = data_less_task(cfg, vocab)
    with torch.device("meta"):
        model = task.build_model()
    return flops_per_sample(cfg, task, model)


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (tp, cp, dp) with tp x cp x dp = world (pp = 1)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(tp, cp, world // (tp * cp)) for tp in divisors for cp in divisors if (world // tp) % cp == 0]


def plan_world(req: Request, configs: LayoutConfigs, common: dict[str, int] | None = None) -> list[LayoutPlan]:
    """Plan every layout of req.world ranks (req.jobs at a time), each with the `common` settings too (the
    --world batch, utils/plan/workload.py); a layout the config checks refuse is kept with its error. A line on
    stderr tells how far the search is (utils/plan/report.py collect)."""
    depths = probe_depths(configs, configs.load({}).model.depth)  # pp = 1: stride 1
    sizes = [{"parallel.tp": tp, "parallel.cp": cp, "parallel.dp": dp, "parallel.pp": 1, **(common or {})}
             for tp, cp, dp in layouts(req.world)]
    plan = partial(plan_or_refusal, configs, hw=req.hardware, world=req.world, depths=depths)
    jobs = min(len(sizes), req.jobs or len(os.sched_getaffinity(0)))
    if jobs > 1:  # forked workers: the imports and the composed config are inherited, not redone
        # forking a process that runs other threads (a host such as a test worker's) can copy a lock another
        # thread holds: then the workers start from a fresh server process instead
        start = "fork" if threading.active_count() == 1 else "forkserver"
        with multiprocessing.get_context(start).Pool(jobs, initializer=one_thread) as pool:
            plans = collect(pool.imap(plan, sizes, chunksize=1), len(sizes), req.world)
    else:
        plans = collect(map(plan, sizes), len(sizes), req.world)
    return sorted(plans, key=lambda p: (bool(p.refused), not p.fits, p.step_time_s))


def plan_or_refusal(configs: LayoutConfigs, settings: dict[str, int], *, hw: Hardware, world: int,
                    depths: tuple[int, ...]) -> LayoutPlan:
    """plan_settings, or the layout with its one-line error when the config checks refuse it."""
    try:
        return plan_settings(configs, settings, hw, world, depths)
    except ConfigError as err:
        name = "-".join(f"{a}{settings[f'parallel.{a}']}" for a in ("tp", "cp", "dp")
                        if settings[f"parallel.{a}"] > 1) or "single"
        overrides = configs.overrides + [f"{k}={v}" for k, v in settings.items()]
        return LayoutPlan(name, overrides, fits=False, refused=err.line())


def one_thread() -> None:
    """A forked worker computes with one thread: one worker per core, and no OpenMP pool from the parent."""
    import torch

    torch.set_num_threads(1)


def as_dict(plan: LayoutPlan) -> dict:
    return {**asdict(plan), "total_bytes": plan.total_bytes}


def run(argv: list[str]) -> str:
    req = parse_args(argv)
    configs = LayoutConfigs(req.overrides, req.vocab)  # Hydra composes once for every layout
    assumed = workload(configs, req.world)  # the vocabulary, batch and sequence planned, and their sources
    if req.world:
        plans = plan_world(req, configs, assumed.settings)
    else:
        cfg = configs.load({})
        plans = [plan_settings(configs, {}, req.hardware, world_of(cfg), configured_probes(configs))]
    if req.as_json:
        return json.dumps({"gpu": req.gpu, "hardware": asdict(req.hardware), "links_from": req.links_from,
                           "workload": assumed.as_dict(), "layouts": [as_dict(p) for p in plans]}, indent=1)
    return table(plans, req, assumed)


def main(argv: list[str] | None = None) -> int:
    return tool_main(__doc__, argv, run)
