"""One planned step: one rank of a layout built on torch's fake process group, one real Trainer.train_step
under a fake-tensor mode (shapes and dtypes, no values, no FLOPs), and the bytes it holds and sends.
The planner (utils/plan/cost_model.py) calls `measure_layout` once per layout and probe depth."""

from __future__ import annotations

from dataclasses import dataclass, field

from utils.plan.fsdp import Unit


@dataclass
class Measured:
    """What one rank of one layout holds and sends in one training step (utils/plan/cost_model.py's figures)."""

    layout: str  # the grid's name: dp8, tp2-cp2-dp2, ...
    held: tuple[int, int, int]  # parameter, gradient, Adam-state bytes
    comm_bytes: dict[str, int]  # axis name -> bytes sent per step
    activation_bytes: int  # peak bytes saved for backward
    flops_per_sample: float  # of the model as built (its depth)
    axis_ranks: dict[str, list[int]] = field(default_factory=dict)  # axis name -> global ranks of the rank's group
    units: tuple[Unit, ...] = ()  # FSDP's units below the root, in forward order (utils/plan/fsdp.py)
    root_bytes: int = 0  # FSDP's root unit, gathered
    rank: int = 0  # the global rank measured


def measure_layout(cfg, world: int, *, rank: int = 0, values: bool = False, vocab: int | None = None) -> Measured:
    """Build the real trainer of global rank `rank` of cfg's layout on a fake group of `world` ranks and take one
    shapes-only step. The weights are built on the meta device and allocated without values (values=True:
    initialised as a run does, the full model's init on the CPU; the same figures). `vocab`: a language
    model's vocabulary (utils/plan/probe.py data_less_task)."""
    import logging
    import tempfile
    import warnings
    from pathlib import Path

    from utils.comm import Axis, init_grid
    from utils.engine.build import build_trainer
    from utils.plan.probe import data_less_task

    with fake_world(world, rank), tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's and the scheduler's warnings about a step that is not one
        grid = init_grid(cfg.parallel)
        check_batch_for(cfg, grid)
        trainer = build_trainer(cfg, data_less_task(cfg, vocab), grid, logging.getLogger("plan"), Path(tmp),
                                values=values)
        comm, activation, units = measure(cfg, grid, trainer)
        held = held_bytes(trainer)  # after the step, which its fake Adam state must not meet
        ranks = {name: grid.axis(*[Axis(a) for a in name.split("_")]).ranks for name in comm}
        trainer.tb.close()
    return Measured(grid.name, held, comm, activation, trainer.flops_per_sample, ranks, *units, rank)


def fake_world(world: int, rank: int = 0):
    """A context: one process as rank `rank` of `world` on torch's fake process group (utils.comm.init_grid
    reads the launch variables), the variables restored and the group destroyed on exit."""
    import contextlib
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from utils.comm import destroy_grid

    @contextlib.contextmanager
    def scope():
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
        try:
            if world > 1:
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            yield
        finally:
            destroy_grid()
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    return scope()


def shapes_only(weights: list):
    """A FakeTensorMode for the planned step: tensors made in it have shapes and dtypes but no values, and
    ops on them compute nothing. Ops whose tensor inputs are all real run for real (the comm byte
    counters, so they count; DDP's buckets), except those reading the `weights` or their views (autocast's
    casts, transposes): those run on the weights' fake counterparts (made once each), so no weight is
    copied and no new real tensor needs converting. A value read from a fake tensor (the non-finite check,
    the loss scaler's) reads as true/1: the step skips its update, which planning does not need."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.utils._pytree import tree_leaves

    from distributed.collectives import issuing
    from utils.bench.train_step import storage_id
    from utils.plan.fsdp import collective_bytes

    held = {storage_id(w) for w in weights}

    class ShapesOnly(FakeTensorMode):
        fsdp_bytes = 0  # bytes this rank sent in FSDP2's collectives (utils/plan/fsdp.py)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "c10d" and not issuing():  # FSDP2's own, not distributed/'s counted ones
                self.fsdp_bytes += collective_bytes(func, args)
            if func is torch.ops.aten._local_scalar_dense.default:
                return True if args[0].dtype == torch.bool else 1
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and not any(isinstance(t, FakeTensor) or storage_id(t) in held for t in tensors):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ShapesOnly(allow_non_fake_inputs=True)


def held_bytes(trainer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of this rank, counted as utils.engine.build.param_bytes_report
    counts them; the Adam state is made as a checkpoint load makes it (no step taken), as fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from distributed.data_parallel import local
    from utils.checkpoints.sharded_state import init_optimizer_state

    params = list(trainer.raw_model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):  # the state's shapes and dtypes, no memory
        init_optimizer_state(trainer.optimizer)
    param_bytes = sum(local(p).numel() * p.element_size() for p in params)
    grad_bytes = sum(local(p).numel() * p.element_size() for p in params if p.requires_grad)
    state = sum(local(t).numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return param_bytes, grad_bytes, state


def measure(cfg, grid, trainer) -> tuple[dict[str, int], int, tuple[tuple[Unit, ...], int]]:
    """(comm bytes per axis, saved-for-backward bytes, FSDP's units and root) of one Trainer.train_step under
    `shapes_only`. FSDP's gathered weights count as weights, not as saved activations; its collectives'
    bytes go to the axis it shards over (utils/plan/fsdp.py)."""
    from utils.bench.train_step import saved_for_backward_bytes
    from utils.plan.fsdp import describe_units, gathered_params, record_forward_order

    model = trainer.raw_model
    mode = shapes_only(list(model.parameters()))
    with mode:
        x, y = trainer.task.example_batch(cfg.trainer.global_batch_size // grid.batch.size, grid.device)
        params = list(model.parameters())  # saved as they are, or as their fake counterparts
        weights = params + [mode.from_tensor(p) for p in params] + gathered_params(model)
        order, hooks = record_forward_order(model)
        grid.reset_comm_bytes()
        mode.fsdp_bytes = 0
        activation = saved_for_backward_bytes(trainer, x, y, params=weights)
    for hook in hooks:
        hook.remove()
    comm = grid.comm_bytes()
    if mode.fsdp_bytes:
        comm[grid.replicas.name] = comm.get(grid.replicas.name, 0) + mode.fsdp_bytes
    return comm, activation, describe_units(model, order)


def check_batch_for(cfg, grid) -> None:
    """The batch checks a launch makes (utils.data.batching.check_batch), without the data's size."""
    from utils.data.batching import check_batch

    batch = cfg.trainer.global_batch_size
    check_batch(batch, grid.batch.size, cfg.trainer.grad_accum_steps, batch)
