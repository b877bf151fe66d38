"""The pipeline a rank runs: torch's schedule over its stages, gradient sync, and a forward-only pass.

`Pipeline.train_step` runs one optimizer step's forward and backward: the rank's share of the global
batch is cut into `grad_accum_steps` chunks, and each chunk is one schedule step of
`parallel.pp_microbatches` microbatches (so microbatches per optimizer step = grad_accum_steps x
pp_microbatches, each of global_batch_size / (dp x grad_accum_steps x pp_microbatches) samples).
The loss of every microbatch is divided by that product before backward (the schedule's own scaling
is off), so the gradients are those of the global-batch mean, as in a single process.

After the last microbatch, `sync_grads` reduces what the stages cannot: the gradients over dp x cp
(one coalesced all-reduce per dtype, summed over cp and averaged over dp, as DDP's hook does without
pp; there is no DDP wrapper under pp, so nothing syncs before the last microbatch; FSDP's units inside the
stages reduce-scatter in the step's last microbatch only, distributed/pipeline/torch_stages.py), and the two
copies of a tied embedding when the first and last stage are on different ranks (summed over the
pipeline's end ranks). `PipelineForward` runs the stages forward only, in order, with blocking
point-to-point sends: validation and greedy decoding, for any input shape.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distributed.collectives import all_reduce_, broadcast_, recv, send
from distributed.data_parallel import sum_grads
from distributed.pipeline.stage_plan import PipelinePlan
from distributed.pipeline.stages import StageModule
from utils import ConfigError
from utils.comm import Axis, Grid
from utils.schema import SCHEDULES

if TYPE_CHECKING:
    from distributed.pipeline.torch_stages import CountedStage


class Pipeline:
    """Schedule, stages and gradient sync of this rank; see the module docstring."""

    def __init__(self, model: nn.Module, stages: list[CountedStage], plan: PipelinePlan, grid: Grid):
        self.model, self.stages, self.plan, self.grid = model, stages, plan, grid
        self.pp, self.replicas = grid.axis(Axis.PP), grid.replicas
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.losses: list[torch.Tensor] = []
        self.divisor, self.scale = 1, None
        self.bubble = float("nan")  # the measured idle fraction, mean over pp (see `train_step`)
        self._timings: deque = deque()  # per step: (each stage's `take_busy`, start mark, end mark), not yet read
        self._bubbles: deque = deque()  # per step: (its pp-mean idle on the host or on its way there, event)
        import torch.distributed.pipelining.schedules as torch_schedules  # a pipeline's run only: brings dynamo

        cls = getattr(torch_schedules, SCHEDULES[plan.schedule][0])
        first = stages[0] if plan.style == "single" else stages
        try:
            self.schedule = cls(first, plan.microbatches, loss_fn=self._loss, scale_grads=False)
        except (ValueError, RuntimeError) as err:  # the config checks should have caught it first
            raise ConfigError(f"pp_schedule={plan.schedule}: {err}", "parallel.pp_schedule",
                              "change parallel.pp_microbatches or parallel.pp_stages_per_rank") from None
        self.tied = _tied_copies(model)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.model.criterion(output, target) / self.divisor
        self.losses.append(loss.detach())
        # plant: pipeline_loss_unscaled (next line)
        return self.scale(loss)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, accum: int, scale) -> torch.Tensor:
        """Forward and backward of this rank's batch (every pp rank passes the same one); returns the
        batch-mean loss on every pp rank (from the last stage) and sets `bubble` (mean idle fraction over
        pp) without a host synchronization: on GPUs the stages' events are read a step late and the fraction
        reduced with the next step's loss, read a step after that, so `bubble` after step s is step s-2's
        (NaN after the first two), and the trainer, which logs step s-1 after queuing step s, logs each
        step's bubble with the next step; on the CPU `bubble` is step s's own.
        `scale`: the loss scaler's scale function."""
        self.losses.clear()
        self.divisor, self.scale = accum * self.plan.microbatches, scale  # plant: pipeline_loss_ignores_accumulation
        # The fp16 scaler starts its scale at its first `scale` call; ranks without the last stage never
        # scale a loss, but their gradients carry the last stage's scale and are unscaled with it.
        scale(torch.zeros((), device=self.grid.device))
        length = self.model.num_tokens(inputs)
        for stage in self.stages:
            stage.reset_busy()
            stage.submod.length = length
        start = _mark(self.grid.device)
        packed = getattr(self.model, "documents", None) is not None  # every stage reads the documents of the ids
        for i, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            for stage in self.stages:  # FSDP reduce-scatters in the step's last microbatch only (torch_stages.py)
                stage.last_chunk = i == accum - 1
            args = (x,) if self.has_first else ()
            kwargs = {"ids": x} if packed else {}  # split into micro-batches with the inputs
            self.schedule.step(*args, target=y if self.has_last else None, return_outputs=False, **kwargs)
        self._timings.append(([s.take_busy() for s in self.stages], start, _mark(self.grid.device)))
        loss = torch.stack(self.losses).sum() if self.losses else torch.zeros((), device=self.grid.device)
        idle = torch.tensor(self._finished_idle(), device=loss.device)
        totals = all_reduce_(torch.stack([loss.float(), idle]), self.pp)
        self._bubbles.append(_to_host(totals[1] / self.pp.size))
        self.bubble = self._read_bubble()
        return totals[0]

    def _lag(self) -> int:
        """Steps a timing or a result waits before the host reads it: 1 on GPUs (its work has run by then),
        0 on the CPU (nothing is queued): utils/engine/step_results.py's rule."""
        return 1 if self.grid.device.type == "cuda" else 0

    def _finished_idle(self) -> float:
        """This rank's idle fraction of the oldest step whose timing is due (NaN before there is one): 1 - the
        stages' compute / the step's wall time."""
        if len(self._timings) <= self._lag():
            return float("nan")
        taken, start, end = self._timings.popleft()
        from distributed.pipeline.torch_stages import busy_seconds  # imported by then (build_stages)

        busy = sum(busy_seconds(t) for t in taken)
        return 1.0 - busy / max(_seconds(start, end), 1e-9)

    def _read_bubble(self) -> float:
        """The newest pp-mean idle fraction that is due on the host (the previous step's reduction on GPUs)."""
        if len(self._bubbles) <= self._lag():
            return float("nan")
        host, event = self._bubbles.popleft()
        if event is not None:
            event.synchronize()
        return float(host)

    def sync_grads(self) -> None:
        """After the last microbatch: the dp x cp reduction, then the tied embedding copies."""
        if self.replicas.size > 1:  # FSDP-sharded blocks (DTensor parameters) were reduce-scattered already
            replicated = [p for p in self.model.parameters() if not isinstance(p, DTensor)]
            torch._foreach_div_(sum_grads(replicated, self.replicas), self.grid.batch.size)
        ends = self.grid.pipeline_ends
        if self.tied is not None and ends is not None and self.tied.grad is not None:
            all_reduce_(self.tied.grad, ends)  # plant: tied_embedding_grads_unsummed

    @property
    def duplicates(self) -> set[int]:
        """ids of parameters another pp rank also holds (the last stage's tied embedding copy): the
        global gradient norm counts them once."""
        return {id(self.tied)} if self.tied is not None and not self.has_first else set()


def _mark(device: torch.device) -> float | torch.cuda.Event:
    """Now, as the host's clock (CPU) or an event on the device's stream (GPUs: the host does not wait)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start, end) -> float:
    """Seconds between two `_mark`s (GPUs: waits until the end event has run)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _to_host(value: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a device scalar to pinned host memory: (the host tensor, the event to wait for; None on
    the CPU, where the value is there already)."""
    if value.device.type != "cuda":
        return value, None
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _tied_copies(model: nn.Module) -> nn.Parameter | None:
    """This rank's copy of a tied input/output embedding when the first and last stage are on
    different ranks (shared in the full model, one end here: `cut_for_rank`'s `pipeline_tied`)."""
    tied = getattr(model, "pipeline_tied", [])
    assert len(tied) <= 1, f"parameters {tied} shared across pipeline ends; one (a tied embedding) is handled"
    return model.get_parameter(tied[0]) if tied else None


class PipelineForward:
    """Forward-only pass through the stages for any batch, called on every pp rank with the same input:
    returns the model's output on the ranks of the last stage and None elsewhere. Other attributes
    (cfg, criterion, context_shards, eval, ...) are the rank's model's."""

    def __init__(self, model: nn.Module, stages: list[StageModule], plan: PipelinePlan, grid: Grid):
        self._model, self._stages, self._plan = model, {s.index: s for s in stages}, plan
        self._pp, self._device = grid.axis(Axis.PP), grid.device

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        plan, me = self._plan, self._pp.rank
        length, carry, out = self._model.num_tokens(x), None, None
        for s in range(plan.num_stages):
            if plan.stage_rank(s) != me:
                continue
            stage = self._stages[s]
            stage.length = length
            if s > 0 and plan.stage_rank(s - 1) != me:  # the sender's stage checked its output against these
                carry = recv(stage.activation_shape(x.shape[0], self._device), stage.activation_dtype, self._device,
                             self._pp, plan.stage_rank(s - 1))
            packed = getattr(self._model, "documents", None) is not None
            carry = stage(x if s == 0 else carry, **({"ids": x} if packed else {}))
            if stage.is_last:
                out = carry
            elif plan.stage_rank(s + 1) != me:
                send(carry, self._pp, plan.stage_rank(s + 1))
        return out

    def from_last_stage(self, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """`value` as the last stage's rank computed it, on every pp rank (`like`: its shape and dtype)."""
        buffer = value if value is not None else torch.empty_like(like)
        return broadcast_(buffer.contiguous(), self._pp, self._plan.stage_rank(self._plan.num_stages - 1))


def from_last_stage(model, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`value` on every pp rank when `model` is a pipeline's forward pass; `value` itself otherwise."""
    return model.from_last_stage(value, like) if isinstance(model, PipelineForward) else value
