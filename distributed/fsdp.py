"""FSDP2 as the data-parallel mode (`parallel.dp_mode=fsdp`): weights, gradients and Adam state sharded
over the ranks that hold the same weights (dp x cp), instead of DDP's full replicas.

`shard_data_parallel` applies torch's `fully_shard` to every transformer block, then to the root (which
keeps the embeddings and the head), on a 1-D mesh over grid.axis('dp', 'cp'). Parameters become DTensors
sharded on dim 0 over that mesh: all-gathered before each block's forward (and again in backward when
`reshard_after_forward`), their gradients reduce-scattered after its backward. Tensor parallelism runs
inside, unchanged: a tp-sharded weight is FSDP-sharded as its local tp shard (the gradients equal the
full model's), so per-rank bytes fall as 1/(dp x tp).

Gradient convention (as DDP's hook here): summed over cp (each cp rank's loss covers only its own tokens
of the same sequences) and averaged over dp, by reduce-scattering in fp32 and dividing by dp
(`set_gradient_divide_factor`; on gloo as a sum and a division). bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
(compute in bf16, reduce and keep the fp32 master weights). The gradient norm (distributed/grad_norm.py)
sums each sharded gradient's squares over this mesh once; checkpoints (distributed/sharded_state.py) save
these DTensors as they are, or, under tp, gathered to the tp shard and resharded on load.

Not composed (refused by the config check, exit 2): fp16 with its loss scaler (FSDP2 has no sharded
inf check; torchtitan offers no fp16 either), and pipeline parallelism.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from utils.comm import Axis, Grid


def fsdp_mesh(grid: Grid) -> DeviceMesh:
    """The 1-D mesh over grid.axis('dp', 'cp') (flattened from the grid's mesh when both are > 1)."""
    names = tuple(a.value for a in sorted((Axis.DP, Axis.CP), key=lambda a: -grid.order.index(a))
                  if grid.size(a) > 1)
    return grid.mesh[names[0]] if len(names) == 1 else grid.mesh[names]._flatten("_".join(reversed(names)))


def shard_data_parallel(model: nn.Module, *, grid: Grid, precision: str, reshard_after_forward: bool) -> nn.Module:
    """fully_shard every block and the root over dp x cp; `model` itself (now an FSDPModule) is returned."""
    if grid.axis(Axis.DP, Axis.CP).size == 1:
        return model
    mesh = fsdp_mesh(grid)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks.children():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(grid.size(Axis.DP)))
            # a factor other than the group size is a PREMUL_SUM reduce-scatter, which gloo lacks: sum, then divide
            module.set_force_sum_reduction_for_comms(grid.device.type == "cpu")
    return model
