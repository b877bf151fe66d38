"""torch's `PipelineStage` over the stages of distributed/pipeline/stages.py: `build_stages` gives this rank's, with
static shapes (no shape-inference pass); `CountedStage` counts the activation and gradient bytes it sends on the
pp axis and the seconds it computes (for the bubble). Imported by runs with a pipeline only: importing
torch.distributed.pipelining costs about a second (it brings torch._dynamo).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from distributed.collectives import nbytes
from distributed.counting import record
from distributed.data_parallel import set_gradient_sync
from distributed.pipeline.stage_plan import PipelinePlan
from distributed.pipeline.stages import StageModule, head_tokens
from utils.comm import AxisGroup


def busy_seconds(taken: float | list) -> float:
    """Seconds of compute that `CountedStage.take_busy` handed over (GPUs: waits until its last event has run)."""
    if not isinstance(taken, list):
        return taken
    if taken:
        taken[-1][1].synchronize()  # recorded last on the stream: every earlier event has run too
    return sum(start.elapsed_time(end) for start, end in taken) / 1e3


class CountedStage(PipelineStage):
    """A PipelineStage that counts the bytes it sends on `axis` and the time it computes (`take_busy`).

    On CPU a chunk's wall time is its compute (gloo's waits block before the chunk starts). On GPUs the
    chunk is timed by CUDA events on the compute stream, which NCCL's receives make wait first: the
    events measure the kernels, not the wait, and the host never synchronizes inside the step; the events
    are read a step later (`busy_seconds` waits for those events only, long run by then).
    """

    def __init__(self, *args, axis: AxisGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.axis = axis
        self.last_chunk = True  # the optimizer step's last accumulation chunk runs (Pipeline.train_step sets it)
        self.reduce_every_microbatch = False  # parallel.fsdp_reduce_every_microbatch (build_stages sets it)
        self.reset_busy()

    def reset_busy(self) -> None:
        self._busy, self._events = 0.0, []

    def take_busy(self) -> float | list:
        """This step's compute, handed over and reset without waiting: seconds on the CPU, the CUDA event pairs
        that time it on GPUs (`busy_seconds` reads either)."""
        taken = self._events if self.device.type == "cuda" else self._busy
        self.reset_busy()
        return taken

    def _timed(self, run, *args, **kwargs):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return run(*args, **kwargs)
            finally:
                end.record()
                self._events.append((start, end))
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            self._busy += time.perf_counter() - start

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """A microbatch's backward, with FSDP's reduce-scatter only in the step's last one: the schedule's last
        microbatch (`last_backward`) of the last accumulation chunk, or every microbatch's with
        `reduce_every_microbatch`. torch syncs a stage only when the stage module itself is FSDP's; here its units
        sit inside (distributed/fsdp.py `root_over_stage`)."""
        set_gradient_sync(self.submod, self.reduce_every_microbatch or (last_backward and self.last_chunk))
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            set_gradient_sync(self.submod, True)

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        record(self.axis, sum(nbytes(op.tensor) for op in ops))
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        record(self.axis, sum(nbytes(op.tensor) for op in ops))
        return ops


def build_stages(model: nn.Module, plan: PipelinePlan, *, axis: AxisGroup, example: torch.Tensor, length: int,
                 out_dtype: torch.dtype, autocast, reduce_every_microbatch: bool = False) -> list[CountedStage]:
    """This rank's torch stages, with static shapes for one microbatch like `example` (meta is fine);
    `reduce_every_microbatch`: FSDP's units inside reduce-scatter after every microbatch's backward."""
    device = next(model.parameters()).device
    mb = example.shape[0]
    stages = []
    for index in plan.stages_of(axis.rank):
        module = StageModule(model, index, plan, autocast)
        module.length = length
        # requires_grad: activations between stages carry gradients back (the first stage's input does not)
        hidden = torch.empty(module.activation_shape(mb, device), dtype=module.activation_dtype, device="meta",
                             requires_grad=True)
        if module.is_last:  # the model's output (torch neither sends nor checks it); cp's layout fixed above
            output = torch.empty(model.output_shape(mb, head_tokens(model, length)), dtype=out_dtype,
                                 device="meta", requires_grad=True)
        stages.append(CountedStage(module, index, plan.num_stages, device, axis=axis,
                                   input_args=example if index == 0 else hidden,
                                   output_args=output if module.is_last else hidden, group=axis.group))
        stages[-1].reduce_every_microbatch = reduce_every_microbatch
    return stages
