"""FSDP2 as the data-parallel mode (`parallel.dp_mode=fsdp`): weights, gradients and Adam state sharded
over the ranks that hold the same weights (dp x cp), instead of DDP's full replicas.

`shard_data_parallel` applies torch's `fully_shard` to every transformer block, to each end module (an
untied embedding, the head) and then to the root (the rest: norms, a tied embedding), on a 1-D mesh over
grid.replicas. Parameters become DTensors
sharded on dim 0 over that mesh: all-gathered before each block's forward (and again in backward when
`reshard_after_forward`), their gradients reduce-scattered after its backward. Tensor parallelism runs
inside, unchanged: a tp-sharded weight is FSDP-sharded as its local tp shard (the gradients equal the
full model's), so per-rank bytes fall as 1/(dp x tp).

Gradient accumulation (several micro-batches per step, or pipeline microbatches): the units reduce-scatter
once per step, in the last micro-batch's backward (distributed/data_parallel.py `no_sync`); until then each
unit adds to an unsharded gradient of its own, so between the first backward and the last a rank holds its
units' whole gradients (over tp): the bytes of k-1 reduce-scatters saved for that memory (utils/plan/fsdp.py
plans it). `parallel.fsdp_reduce_every_microbatch=true` takes the other side of the trade: a reduce-scatter after
every micro-batch's backward, the gradients sharded throughout.

Gradient convention (as DDP's hook here): summed over cp (each cp rank's loss covers only its own tokens
of the same sequences) and averaged over dp, by reduce-scattering in fp32 and dividing by grid.batch's size
(`set_gradient_divide_factor`; on gloo as a sum and a division). The gradient norm (distributed/grad_norm.py)
sums each sharded gradient's squares over this mesh once; checkpoints (utils/checkpoints/sharded_state.py) save
these DTensors as they are, or, under tp, gathered to the tp shard and resharded on load.

Precision: FSDP's policy casts nothing (`MixedPrecisionPolicy(reduce_dtype=fp32)` for every mode); bf16
comes from the trainer's autocast, exactly as under DDP. So FSDP bf16 trains the same recipe as DDP bf16
(equal losses up to reduction order): matmuls in bf16, while the residual stream, the layer norms, the
embeddings and every gradient stay fp32, and a block returns the dtype it was given, which the pipeline
declares between its stages (distributed/pipeline/stages.py). The cost: the gathers move fp32 weights
(twice the bytes of a bf16 gather) and autocast casts each gathered weight per use. The alternatives
were measured and rejected (the losses: docs/measurements.md): `param_dtype=bf16` casts each block's
input, so the residual stream is bf16 and so is a stage's output (the next stage read those bytes as
fp32: garbage). `cast_forward_inputs=False`
feeds the fp32 stream to bf16 layer-norm weights, which CPU layer_norm refuses ("mixed dtype (CPU):
expect parameter to have scalar type of Float") and which round the norms' weights anyway;
`output_dtype=fp32` keeps the stream bf16 inside each block and hits the same error at the final norm.

Under pipeline parallelism only the blocks are sharded (the stages call the cut model's blocks and ends
directly, so the model's forward never runs): each stage's blocks get one FSDP root of their own
(`root_over_stage`, over the stage's `StageBlocks`, which holds no parameter), reduce-scattering in the step's
last microbatch's backward only (distributed/pipeline/torch_stages.py), and the stages' ends stay replicated and
are reduced with the pipeline's dp sync; Adam gets the two kinds in separate parameter groups
(`param_groups`). Without that root each block was its own root, with its own communication state, and
FSDP keeps each state's last reduce-scatter input (the block's whole gradient) until that state's backward
ends: every block of the stage at once (gpt_medium pp2 x dp2: 0.6 GiB more per rank, docs/memory.md).
Use `fsdp_reshard_after_forward=false` there, or every microbatch gathers each block twice.

Refused by the config check (exit 2): fp16 with its loss scaler (FSDP2's sharded gradients and the
scaler's inf check are unverified together; torchtitan offers no fp16 either), and the pipeline
schedules that split backward into input and weight gradients (zero bubble), which bypass FSDP's
gradient hooks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from utils.comm import Grid


def shard_data_parallel(model: nn.Module, *, grid: Grid, reshard_after_forward: bool,
                        pipeline: bool = False) -> nn.Module:
    """fully_shard every block and the root over dp x cp; `model` itself (now an FSDPModule) is returned.
    No precision setting: autocast computes in bf16 under every dp mode (see the module docstring).
    `pipeline`: `model` is this rank's cut of the pipeline, whose stages call its blocks and ends
    directly (the root's forward never runs): only the blocks are sharded, each its own FSDP root; the
    ends stay replicated and the pipeline's dp reduction covers them (distributed/pipeline/schedule.py)."""
    if grid.replicas.size == 1:
        return model
    mesh = grid.replica_mesh  # 1-D over dp x cp
    # no param_dtype: autocast does the casting, as under DDP (module docstring)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # plant: fsdp_casts_params_to_bf16, fsdp_reduces_in_bf16
    for block in model.blocks.children():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if not pipeline:
        for end in _separable_ends(model):  # gathered only while they run, not for the whole step with the root
            fully_shard(end, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(grid.batch.size))
            # a factor other than the group size is a PREMUL_SUM reduce-scatter, which gloo lacks: sum, then divide
            module.set_force_sum_reduction_for_comms(grid.device.type == "cpu")
    return model


def root_over_stage(blocks: nn.Module, *, grid: Grid) -> nn.Module:
    """Under pp: one FSDP root over a stage's already sharded blocks (distributed/pipeline/stages.py
    `StageBlocks`, no parameter of its own), so they share one communication state: FSDP then keeps one
    reduce-scatter input in flight for the stage instead of one per block until the backward ends, and
    prefetches the next block in backward as it does without pp. Not the stage module itself: torch's
    pipelining turns gradient sync and resharding off for every microbatch but the last when a stage's
    module is an FSDPModule (the whole stage's gathered weights and gradients held for the step)."""
    if grid.replicas.size == 1 or not any(isinstance(m, FSDPModule) for m in blocks.children()):
        return blocks
    return fully_shard(blocks, mesh=grid.replica_mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))


def _separable_ends(model: nn.Module) -> list[nn.Module]:
    """The modules around the blocks (the model's PIPELINE_ENDS: embeddings, head) that hold parameters no other
    module shares: each its own FSDP unit, so that a large vocabulary's embedding and head are gathered one at
    a time, while they run, instead of with the root for the whole step (llama_8b tp2 x fsdp32: 2.1 GB
    gathered for the step). A tied embedding and head stay in the root (FSDP2 keeps a shared parameter in one unit)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    names = [name for names in model.PIPELINE_ENDS.values() for name in names]
    ends = [getattr(model, name, None) for name in names]
    return [end for end in ends if isinstance(end, nn.Module) and any(True for _ in end.parameters())
            and all(holders[id(p)] == 1 for p in end.parameters())]


def param_groups(model: nn.Module) -> list[dict]:
    """Optimizer parameter groups: FSDP's DTensor parameters apart from plain ones (a pipeline rank's
    replicated ends), since Adam's foreach and fused kernels cannot mix the two in one group."""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]
