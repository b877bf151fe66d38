"""Plan a layout before launching it: `python -m utils.plan [overrides] [gpu=h100|a100|cpu] [options]`.

Prints, for global rank 0 of a layout (or with --world N for every tp x cp x dp layout of N ranks),
the bytes it holds (parameters, gradients, Adam state, activations saved for backward), the bytes it
sends per training step on each grid axis, and a predicted step time, ranked by that time.

    python -m utils.plan model=vit_large data=era5 precision=bf16 gpu=h100 --world 8
    python -m utils.plan parallel=tp2 parallel.dp=2 gpu=cpu --json

Nothing is computed from a second copy of the formulas: the planner builds the real trainer
(utils.engine.build.build_trainer) on one process under torch's fake process group (collectives do nothing,
the counted ones in distributed/ still record their bytes) and takes one real Trainer.train_step under
a fake-tensor mode (shapes and dtypes, no values, no FLOPs). The comm figures are the comm/<axis>_bytes a
real run logs; the activation figure is utils.bench.train_step.saved_for_backward_bytes; parameter, gradient and
optimizer bytes are counted as utils.engine.build.param_bytes_report does (Adam's two moments; its 4-byte step
counts are left out as there). Rank 0 holds the largest shard of an uneven tp split.

Options (defaults by gpu: h100 | a100 | cpu):
  gpu=NAME            h100 (default) | a100 | cpu
  --world N           plan every layout of N ranks (tp x cp x dp, pp=1) the config checks accept
  --json              print JSON: per layout comm_bytes {axis: bytes per step}, param_bytes, grad_bytes,
                      optimizer_bytes, activation_bytes (rank 0), step_time_s, compute_s, comm_s, fits
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
Fits = parameters + gradients + Adam state + saved activations <= memory (no allocator slack, workspace
or bf16 weight copies). Not modelled (refused with exit 2): pipeline parallelism (parallel.pp > 1; its
object exchanges do not run on a fake group) and parallel.dp_mode=fsdp (FSDP2's all-gathers and
reduce-scatters are torch's own and not counted in comm/<axis>_bytes).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

from utils import ConfigError, exit_bad_input, require
from utils.plan.bandwidths import read_bandwidths

GB = 1e9


@dataclass
class Hardware:
    """Figures of one device kind: peak (utils.engine.flops.PEAK_TFLOPS key, or a number), links, memory."""

    peak: str | float  # PEAK_TFLOPS key, or dense TFLOP/s per device
    intra_gbs: float  # GB/s per direction between ranks of one node
    inter_gbs: float  # GB/s per GPU between nodes
    gpus_per_node: int
    memory_gb: float  # memory per device, GB (1e9 bytes)
    efficiency: float = 0.5  # fraction of the peak a step achieves


GPUS = {"h100": Hardware("H100", 450.0, 50.0, 8, 80.0), "a100": Hardware("A100", 300.0, 50.0, 8, 80.0),
        "cpu": Hardware(0.2, 5.0, 5.0, 1000, 1000.0)}
PCIE_GBS = 25.0
OPTIONS = {"--efficiency": "efficiency", "--peak-tflops": "peak", "--intra-gbs": "intra_gbs",
           "--inter-gbs": "inter_gbs", "--gpus-per-node": "gpus_per_node", "--memory-gb": "memory_gb"}


@dataclass
class Request:
    overrides: list[str]
    hardware: Hardware
    gpu: str = "h100"
    world: int = 0  # 0: plan the one layout the overrides give
    as_json: bool = False
    links_from: str = ""  # --bandwidths: the doctor's file the link figures come from


@dataclass
class LayoutPlan:
    """What rank 0 of one layout holds and sends in one training step, and the predicted step time."""

    layout: str
    overrides: list[str]
    comm_bytes: dict[str, int] = field(default_factory=dict)  # axis -> bytes rank 0 sends per step
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0  # peak bytes saved for backward
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_time_s: float = 0.0
    fits: bool = True
    refused: str = ""  # the one-line error of a layout the code refuses

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def parse_args(argv: list[str]) -> Request:
    """Planner options out of argv; the rest are Hydra overrides."""
    req, values, it = Request([], GPUS["h100"]), {}, iter(argv)
    pcie, measured = False, None
    for arg in it:
        key, eq, value = arg.partition("=")
        if key == "gpu":
            require(value in GPUS, f"unknown gpu '{value}'", "gpu", "choose " + ", ".join(GPUS))
            req.gpu = value
        elif key == "--bandwidths":
            value = value if eq else next(it, "")
            require(bool(value), "--bandwidths needs a file", "--bandwidths", "give the doctor's bandwidths JSON")
            measured = read_bandwidths(value)
        elif key in OPTIONS or key == "--world":
            value = value if eq else next(it, "")
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            require(number > 0, f"bad {key} value '{value}'", key, "give a positive number")
            values[key] = number
        elif arg in ("--json", "--pcie"):
            req.as_json, pcie = req.as_json or arg == "--json", pcie or arg == "--pcie"
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option '{arg}'", arg, "see python -m utils.plan --help")
        else:
            req.overrides.append(arg)
    req.world = int(values.pop("--world", 0))
    hw = Hardware(**asdict(GPUS[req.gpu]))
    hw.intra_gbs = PCIE_GBS if pcie else hw.intra_gbs
    if measured is not None:  # the doctor's figures replace the preset's; explicit flags (below) win
        hw.intra_gbs = measured.intra_gbs or hw.intra_gbs
        hw.inter_gbs = measured.inter_gbs or hw.inter_gbs
        req.links_from = measured.source()
    for key, number in values.items():
        setattr(hw, OPTIONS[key], int(number) if key == "--gpus-per-node" else number)
    req.hardware = hw
    return req


def peak_tflops(hw: Hardware, precision: str) -> float:
    from utils.engine.flops import PEAK_TFLOPS

    return PEAK_TFLOPS[hw.peak][precision] if isinstance(hw.peak, str) else float(hw.peak)


def link_gbs(hw: Hardware, ranks: list[int]) -> float:
    """Bandwidth of the link a group of global ranks crosses: intra-node when they share a node."""
    return hw.intra_gbs if len({r // hw.gpus_per_node for r in ranks}) == 1 else hw.inter_gbs


def check_plannable(cfg) -> None:
    par = cfg.parallel
    require(par.pp == 1, "the planner does not model pipeline parallelism yet", "parallel.pp",
            "plan with parallel.pp=1 (pp=1 layouts of the same world size are listed with --world)")
    require(par.dp_mode == "ddp", "the planner does not model FSDP yet (FSDP2's own collectives are not counted)",
            "parallel.dp_mode", "plan with parallel.dp_mode=ddp")


def world_of(overrides: list[str]) -> int:
    """Ranks the overrides' layout needs (as train_mp.py counts them), validated like a launch."""
    from utils.comm import check_grid
    from utils.cli.config import load_config
    from utils.cli.launch import LaunchEnv, ranks_needed

    par = load_config(overrides)[0].parallel
    world = ranks_needed(par)
    check_grid(par, LaunchEnv(world_size=world))
    return world


def fake_world(world: int):
    """A context: one process as rank 0 of `world` on torch's fake process group (utils.comm.init_grid
    reads the launch variables), the variables restored and the group destroyed on exit."""
    import contextlib
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from utils.comm import destroy_grid

    @contextlib.contextmanager
    def scope():
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
        try:
            if world > 1:
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            yield
        finally:
            destroy_grid()
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    return scope()


def shapes_only():
    """A FakeTensorMode for the planned step: tensors made in it have shapes and dtypes but no values, and
    ops on them compute nothing. Ops whose tensor inputs are all real (the comm byte counters, the built
    weights' views) run for real, so the counters count. A value read from a fake tensor (the non-finite
    check, the loss scaler's) reads as true/1: the step skips its update, which planning does not need."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.utils._pytree import tree_leaves

    class ShapesOnly(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._local_scalar_dense.default:
                return True if args[0].dtype == torch.bool else 1
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ShapesOnly(allow_non_fake_inputs=True)


def held_bytes(trainer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of this rank, counted as utils.engine.build.param_bytes_report
    counts them; the Adam state is allocated as a checkpoint load does (no step taken)."""
    import torch

    from distributed.data_parallel import local
    from utils.checkpoints.sharded_state import init_optimizer_state

    params = list(trainer.raw_model.parameters())
    init_optimizer_state(trainer.optimizer)
    param_bytes = sum(local(p).numel() * p.element_size() for p in params)
    grad_bytes = sum(local(p).numel() * p.element_size() for p in params if p.requires_grad)
    state = sum(local(t).numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return param_bytes, grad_bytes, state


def measure(cfg, grid, trainer) -> tuple[dict[str, int], int]:
    """(comm bytes per axis, saved-for-backward bytes) of one Trainer.train_step under `shapes_only`."""
    from utils.bench.train_step import saved_for_backward_bytes

    mode = shapes_only()
    with mode:
        x, y = trainer.task.example_batch(cfg.trainer.global_batch_size // grid.batch.size, grid.device)
        params = list(trainer.raw_model.parameters())  # saved as they are, or as their fake counterparts
        weights = params + [mode.from_tensor(p) for p in params]
        grid.reset_comm_bytes()
        activation = saved_for_backward_bytes(trainer, x, y, params=weights)
    return grid.comm_bytes(), activation


def plan_layout(overrides: list[str], hw: Hardware, world: int, *, values: bool = False) -> LayoutPlan:
    """Build the real trainer of rank 0 of this layout on a fake group and take one shapes-only step.
    The weights are built on the meta device and allocated without values (values=True: initialised
    as a run does; the same figures, tests/test_plan.py checks it, at the cost of the full model's init)."""
    import logging
    import tempfile
    import warnings
    from pathlib import Path

    from utils.engine.build import build_trainer
    from utils.comm import Axis, init_grid
    from utils.cli.config import load_config
    from utils.tasks import build_task

    cfg = load_config(overrides)[0]
    check_plannable(cfg)
    with fake_world(world), tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's and the scheduler's warnings about a step that is not one
        grid = init_grid(cfg.parallel)
        check_batch_for(cfg, grid)
        trainer = build_trainer(cfg, build_task(cfg, load_data=False), grid, logging.getLogger("plan"), Path(tmp),
                                values=values)
        plan = LayoutPlan(grid.name, list(overrides))
        plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes = held_bytes(trainer)
        plan.comm_bytes, plan.activation_bytes = measure(cfg, grid, trainer)
        links = {name: link_gbs(hw, grid.axis(*[Axis(a) for a in name.split("_")]).ranks) for name in plan.comm_bytes}
        flops = trainer.flops_per_sample * cfg.trainer.global_batch_size / grid.world_size
        trainer.tb.close()
    plan.compute_s = flops / (peak_tflops(hw, cfg.precision.mode) * 1e12 * hw.efficiency)
    plan.comm_s = sum(n / (links[name] * GB) for name, n in plan.comm_bytes.items())
    plan.step_time_s = plan.compute_s + plan.comm_s
    plan.fits = plan.total_bytes <= hw.memory_gb * GB
    return plan


def check_batch_for(cfg, grid) -> None:
    """The batch checks a launch makes (utils.data.batching.check_batch), without the data's size."""
    from utils.data.batching import check_batch

    batch = cfg.trainer.global_batch_size
    check_batch(batch, grid.batch.size, cfg.trainer.grad_accum_steps, batch)


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (tp, cp, dp) with tp x cp x dp = world (pp = 1)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(tp, cp, world // (tp * cp)) for tp in divisors for cp in divisors if (world // tp) % cp == 0]


def plan_world(req: Request) -> list[LayoutPlan]:
    """Plan every layout of req.world ranks; a layout the config checks refuse is kept with its error."""
    plans = []
    for tp, cp, dp in layouts(req.world):
        sizes = [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.dp={dp}", "parallel.pp=1"]
        overrides = req.overrides + sizes
        try:
            plans.append(plan_layout(overrides, req.hardware, req.world))
        except ConfigError as err:
            name = "-".join(f"{a}{n}" for a, n in (("tp", tp), ("cp", cp), ("dp", dp)) if n > 1) or "single"
            plans.append(LayoutPlan(name, overrides, fits=False, refused=err.line()))
    return sorted(plans, key=lambda p: (bool(p.refused), not p.fits, p.step_time_s))


def as_dict(plan: LayoutPlan) -> dict:
    return {**asdict(plan), "total_bytes": plan.total_bytes}


def table(plans: list[LayoutPlan], req: Request) -> str:
    """Markdown table ranked by predicted step time (layouts that do not fit and refused ones last)."""
    hw = req.hardware
    lines = [f"planner: gpu={req.gpu}, peak {hw.peak} x efficiency {hw.efficiency}, links intra {hw.intra_gbs} / "
             f"inter {hw.inter_gbs} GB/s{f' (--bandwidths {req.links_from})' if req.links_from else ''}, "
             f"{hw.gpus_per_node} per node, {hw.memory_gb} GB; rank 0; no overlap",
             "| rank | layout | fits | step s | compute s | comm s | params GiB | grads GiB | Adam GiB | "
             "activations GiB | total GiB | comm MB per step by axis |", "|" + "---|" * 12]
    for i, p in enumerate(plans, 1):
        if p.refused:
            lines.append(f"| - | {p.layout} | refused | {p.refused} |" + " |" * 8)
            continue
        gib = [f"{n / 2**30:.2f}" for n in (p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes,
                                            p.total_bytes)]
        comm = ", ".join(f"{a} {n / 1e6:.1f}" for a, n in p.comm_bytes.items()) or "none"
        lines.append(f"| {i} | {p.layout} | {'yes' if p.fits else 'NO'} | {p.step_time_s:.4g} | {p.compute_s:.4g} "
                     f"| {p.comm_s:.4g} | " + " | ".join(gib) + f" | {comm} |")
    return "\n".join(lines)


def run(argv: list[str]) -> str:
    req = parse_args(argv)
    if req.world:
        plans = plan_world(req)
    else:
        plans = [plan_layout(req.overrides, req.hardware, world_of(req.overrides))]
    if req.as_json:
        return json.dumps({"gpu": req.gpu, "hardware": asdict(req.hardware), "links_from": req.links_from,
                           "layouts": [as_dict(p) for p in plans]}, indent=1)
    return table(plans, req)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        print(run(argv), flush=True)
    except ConfigError as err:
        exit_bad_input(err)
    return 0
