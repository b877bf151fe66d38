"""Context parallelism for a (possibly tensor-parallel) model: split its sequence over the cp axis.

`parallelize_context(model, grid=grid, variant=...)` runs after tensor parallelism and changes, over
the grid's cp axis:
- the 'enter' marker (or the sequence-parallel split tp put there): this rank's tokens are kept first
  (`ContextShards.shard`), then tp splits them further under sequence parallelism. The layout is
  balanced for causal models, contiguous otherwise (`distributed/context/layout.py`); everything
  before the split (embeddings, the ViT's position table) runs on the full sequence, so position
  embeddings are sliced with the tokens;
- every attention module the model declares (`model.parallel_plan()`, networks/parallel_plan.py): its
  core becomes `ContextParallelAttention` (all-gather or ring), and its rotary tables are read at the
  global positions of this rank's tokens;
- the 'output' marker (the ViT, after its head): the per-token outputs are gathered back into the
  full sequence, so the model's output and loss are the single-process ones on every cp rank;
- without an 'output' marker (the LM), the criterion sees this rank's tokens: `ContextParallelLoss`
  takes the matching targets and averages the per-rank means over cp;
- dropouts inside the region (attention, and the blocks' declared residual and MLP ones) act on
  cp-sharded activations and draw a mask per shard over (tp, cp) or (cp) (`distributed/rng.py`); the
  embeddings' dropout, before the split, keeps the default stream, replicated over cp.
Then `check_followed` refuses (ConfigError) a model with weights or an attention core in its blocks that
the plan leaves out: a serial attention there would attend to this rank's tokens only.

Gradients: every weight sees only this rank's tokens, so its gradient is partial over cp; the loss is
the same on every cp rank, so the data-parallel reduction sums over cp and averages over dp
(`distributed/data_parallel.py`). The model gets a `context_shards` attribute (greedy decoding reads it).
"""

from __future__ import annotations

import torch
from torch import nn

from distributed.context.attention import ContextParallelAttention
from distributed.context.layout import ContextShards
from distributed.mappings import reduce_from_region
from distributed.rng import ShardedRandom, per_shard
from distributed.tensor.layers import ScatterSequence
from networks.blocks import ScaledDotProductAttention, SequenceRegion
from networks.parallel_plan import ParallelModel, ParallelPlan, check_followed
from utils import ConfigError
from utils.comm import Axis, AxisGroup, Grid


class EnterContext(nn.Module):
    """Keep this rank's tokens of the full sequence, then apply `inner` (tp's split, or an identity)."""

    def __init__(self, shards: ContextShards, inner: nn.Module, seq_dim: int = 1):
        super().__init__()
        self.shards, self.inner, self.seq_dim = shards, inner, seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shards.enter(x.shape[self.seq_dim], x.device)
        return self.inner(self.shards.shard(x, self.seq_dim))


class GatherContext(nn.Module):
    """Every rank's per-token outputs, in sequence order (fwd all-gather, bwd this rank's part)."""

    def __init__(self, shards: ContextShards, seq_dim: int = 1):
        super().__init__()
        self.shards, self.seq_dim = shards, seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.unshard(x, self.seq_dim)


class ContextParallelLoss(nn.Module):
    """A per-token mean loss on this rank's tokens, averaged over cp: the full-sequence mean.

    Exact when every cp rank counts the same number of targets (equal shards, no ignored targets:
    the case of every training and validation block). Backward: 1/cp of the local gradient.
    """

    def __init__(self, inner: nn.Module, shards: ContextShards):
        super().__init__()
        self.inner, self.shards = inner, shards

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        local = self.inner(logits, self.shards.shard(targets, 1))
        return reduce_from_region(local, self.shards.axis) / self.shards.axis.size


def parallelize_context(model: ParallelModel, *, grid: Grid, variant: str) -> nn.Module:
    """Split `model`'s sequence over grid's cp axis in place (after tp) and return it; unchanged at cp=1."""
    axis = grid.axis(Axis.CP)
    if axis.size == 1:
        return model
    plan = model.parallel_plan()
    causal = any(_core(part.module.attend).causal for part in plan.in_blocks(model, "attention"))
    shards = ContextShards(axis, balanced=causal)
    hierarchy = grid.cp_hierarchy if variant == "hierarchical" else None
    assert variant != "hierarchical" or hierarchy is not None, "init_grid builds the hierarchy's groups at start"
    _swap_attention_and_dropouts(model, plan, shards, variant, grid.axis(Axis.TP), hierarchy)
    if not _swap_regions(model, shards):
        criterion = plan.outside(model, plan.criterion)
        criterion.replace(ContextParallelLoss(criterion.module, shards))
    model.context_shards = shards
    check_followed(model, plan, f"parallel.cp={axis.size}")
    assert all(isinstance(_core(part.module.attend), ContextParallelAttention)
               for part in plan.in_blocks(model, "attention")), "a declared attention core was left serial"
    return model


def _core(module: nn.Module) -> nn.Module:
    """The module inside tp's per-shard dropout stream, if it has one."""
    return module.inner if isinstance(module, ShardedRandom) else module


def _swap_attention_and_dropouts(model: nn.Module, plan: ParallelPlan, shards: ContextShards, variant: str,
                                 tp: AxisGroup, hierarchy) -> None:
    """cp attention cores reading the token layout; per-shard dropout streams inside the region."""
    cp = shards.axis
    for part in plan.in_blocks(model, "attention"):
        serial = _core(part.module.attend)
        if type(serial) is not ScaledDotProductAttention:  # a window or sliding core would be lost, not split
            raise ConfigError(f"{part.name}.attend is a {type(serial).__name__}, not the plain softmax attention "
                              "(networks.blocks.ScaledDotProductAttention) that context parallelism distributes",
                              "parallel.cp", "set parallel.cp=1 for this model")
        core = ContextParallelAttention.from_serial(serial, shards, variant, hierarchy)
        part.module.attend = per_shard(core, (tp, cp))
        part.module.positions = shards
    for part in plan.in_blocks(model, "dropouts"):  # tokens split over cp (and over tp under sequence parallelism)
        split_by_tp = isinstance(part.module, ShardedRandom)
        part.replace(per_shard(_core(part.module), (tp, cp) if split_by_tp else (cp,)))


def _swap_regions(model: nn.Module, shards: ContextShards) -> bool:
    """The 'enter' marker (or tp's split there) keeps this rank's tokens first; the 'output' marker
    gathers them. Returns whether the model has an 'output' marker."""
    found = {"enter": 0, "output": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ScatterSequence) or (isinstance(child, SequenceRegion) and child.kind == "enter"):
                setattr(parent, name, EnterContext(shards, child, child.seq_dim))
                found["enter"] += 1
            elif isinstance(child, SequenceRegion) and child.kind == "output":
                setattr(parent, name, GatherContext(shards, child.seq_dim))
                found["output"] += 1
    assert found["enter"] == 1, f"context parallelism needs exactly one 'enter' region, found {found['enter']}"
    return found["output"] > 0
