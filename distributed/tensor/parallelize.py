"""Tensor (and sequence) parallelism for a serial model: swap its layers in place for parallel ones.

`parallelize(model, grid=grid, sequence_parallel=...)` shards over the grid's tp axis what the model
declares in `model.parallel_plan()` (networks/parallel_plan.py), in every block it holds:
- the column linears column-parallel, the row linears row-parallel (Megatron's pairs: the fused `qkv`
  with `proj`, `fc1` with `fc2`); whole heads per rank, because a declared attention's fused QKV orders
  its output features (head, {q,k,v}, head_dim);
- the vocabulary parts (the language model): the token embedding vocab-parallel, the head column-parallel
  over the vocabulary without gathering (still tied to the embedding when it was), the criterion the
  vocab-parallel cross-entropy;
- under sequence parallelism (Korthikanti et al. 2022): the declared norms (the blocks' and the final
  one) become sequence-parallel, the `SequenceRegion` markers split ('enter') and gather ('exit') the
  sequence over tp, and the linears all-gather / reduce-scatter along the sequence instead of all-reduce.
  Without it the regions stay identities.
- dropout on sharded activations draws a mask per shard (`distributed.rng`): the attention core's
  (heads are split) always, the blocks' declared dropouts (residual, MLP) under sequence parallelism
  (tokens are split). Dropouts on replicated activations (the embeddings', and the blocks' without
  sequence parallelism) keep the default stream, which agrees across tp, so every rank applies the same mask.
Then `check_followed` refuses (ConfigError) a model with weights or an attention core in its blocks that
the plan leaves out: it would stay serial, with partial gradients or this rank's tokens only.

Weights are copied shard by shard from the serial model (`from_serial`), so the full weights of a
parallel model equal the serial ones. Per block and training step the blocks move 8(t-1)/t x A bytes
on tp (A = batch x tokens x hidden x bytes per element of the matmuls: 4 in fp32, 2 under bf16/fp16
autocast, since column-parallel inputs are cast before they are communicated) without sequence
parallelism, and 10(t-1)/t x A with it (the two column-parallel layers all-gather their input again in
backward; 8(t-1)/t x A with `keep_gathered`). On gloo each of a block's 4 reduce-scatters runs as an
all-reduce that keeps this rank's chunk (cheaper there, `distributed.collectives.reduce_scatter_via`):
14(t-1)/t x A with sequence parallelism, 12(t-1)/t x A with `keep_gathered`.

`sequence_parallel_on` resolves the setting: unset, it is on with GPUs and off on CPU/gloo, where its
extra collectives cost more than they save (docs/measurements.md); `sequence_parallel_notice` is the log's line.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed.rng import per_shard
from distributed.tensor.layers import (
    ColumnParallelLinear,
    GatherSequence,
    GroupedQKVParallelLinear,
    RowParallelLinear,
    ScatterSequence,
    SequenceParallelNorm,
    SequenceShards,
    TensorParallelLayer,
)
from distributed.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from networks.blocks import SequenceRegion
from networks.parallel_plan import ParallelModel, ParallelPlan, Part, check_followed
from utils import ConfigError
from utils.comm import Axis, AxisGroup, Grid


def sequence_parallel_on(setting: bool | None, device: torch.device) -> bool:
    """`parallel.sequence_parallel` as set, or when unset (None) by device: on with GPUs (Megatron's schedule,
    activations 1/t per rank), off on the CPU, where gloo's collectives cost more than their bytes and
    sequence parallelism's 2.5x as many of them make a tp step slower than without it."""
    return device.type != "cpu" if setting is None else setting


def sequence_parallel_notice(setting: bool | None, device: torch.device) -> str | None:
    """The log's one line about sequence parallelism under tp on the CPU (None elsewhere)."""
    if device.type != "cpu":
        return None
    if setting is None:
        return ("parallel.sequence_parallel unset: off on CPU/gloo, where its extra collectives cost more than the "
                "activation memory it saves (docs/measurements.md); parallel.sequence_parallel=true turns it on")
    if setting:
        return ("on CPU/gloo, sequence parallelism's extra collectives make a tp step slower than "
                "parallel.sequence_parallel=false (docs/measurements.md); unset it where activation memory allows")
    return None


def parallelize(model: ParallelModel, *, grid: Grid, sequence_parallel: bool, keep_gathered: bool = False) -> nn.Module:
    """Shard `model` over grid's tp axis in place and return it (unchanged at tp == 1). `keep_gathered`:
    column-parallel layers under sequence parallelism save their gathered input, not their shard.

    tp must divide every attention layer's head count (a user setting each family refuses before any rank starts:
    its `check_layout`, networks/layout.py).
    """
    axis = grid.axis(Axis.TP)
    if axis.size == 1:
        return model
    plan = model.parallel_plan()
    heads = [part.module.num_heads for part in plan.in_blocks(model, "attention")]
    assert all(h % axis.size == 0 for h in heads), f"heads {heads} cannot be split over tp={axis.size}"
    shards = SequenceShards(axis)
    column = dict(sequence_parallel=sequence_parallel, shards=shards, keep_gathered=keep_gathered)
    _parallelize_vocab(model, plan, axis, column)
    grouped = _grouped_qkv(model, plan, axis, column)
    for part in plan.in_blocks(model, "column"):
        if part.name not in grouped:
            part.replace(ColumnParallelLinear.from_serial(_serial(part, nn.Linear), axis, **column))
    for part in plan.in_blocks(model, "row"):
        part.replace(RowParallelLinear.from_serial(_serial(part, nn.Linear), axis, sequence_parallel=sequence_parallel))
    for part in plan.in_blocks(model, "attention"):
        part.module.attend = per_shard(part.module.attend, (axis,))  # heads are split over tp
    if sequence_parallel:
        _parallelize_sequence_region(model, plan, axis, shards)
    check_followed(model, plan, f"parallel.tp={axis.size}")
    for role in ("column", "row", "norms") if sequence_parallel else ("column", "row"):
        assert all(isinstance(p.module, TensorParallelLayer) for p in plan.in_blocks(model, role)), role
    return model


def _grouped_qkv(model: nn.Module, plan: ParallelPlan, axis: AxisGroup, column: dict) -> set[str]:
    """Grouped-query attention with fewer key/value heads than tp ranks: each rank keeps its queries'
    group whole (`GroupedQKVParallelLinear`); returns the names of the projections so replaced. With tp
    dividing the key/value heads, the plain column split already gives each rank whole groups."""
    done = set()
    for part in plan.in_blocks(model, "attention"):
        attn = part.module
        if getattr(attn, "num_kv_heads", attn.num_heads) % axis.size == 0:  # (multi-head attention need not say)
            continue
        qkv = f"{part.name}.qkv"
        # a user setting the family refuses earlier (networks/transformer.py `check_layout`): here an invariant
        assert not (axis.size % attn.num_kv_heads or attn.q_per_group % (axis.size // attn.num_kv_heads)), \
            f"{part.name}: {attn.num_kv_heads} key/value heads over tp={axis.size}"
        serial = _serial(Part(attn, "qkv", qkv, attn.qkv), nn.Linear)
        attn.qkv = GroupedQKVParallelLinear(serial, axis, attn.num_kv_heads, attn.q_per_group, attn.head_dim, **column)
        attn.q_per_group = attn.qkv.q_local
        done.add(qkv)
    return done


def _serial(part: Part, kind: type[nn.Module]) -> nn.Module:
    """The declared module when it is exactly `kind` (the serial layer with a tensor-parallel version)."""
    if type(part.module) is not kind:
        raise ConfigError(f"{part.name} is declared as a {kind.__name__} to split over tp but is a "
                          f"{type(part.module).__name__}, which has no tensor-parallel version", "parallel.tp",
                          f"declare only {kind.__name__} modules in that role, or set parallel.tp=1")
    return part.module


def _parallelize_vocab(model: nn.Module, plan: ParallelPlan, axis: AxisGroup, column: dict) -> None:
    """Language models: vocab-parallel embedding, head (tie kept) and criterion, where the plan names them
    and this rank holds them (a pipeline rank holds the embedding only on its first stage, the head on its last).

    The embedding all-reduces (no sequence split of its own) because positions are added and the
    sequence is split afterwards, at the model's 'enter' region. The head reads the sequence-parallel
    layout of the final norm and all-gathers it, so logits are (B, S, V_local) with replicated targets.
    """
    embed, head = plan.outside(model, plan.vocab_embedding), plan.outside(model, plan.vocab_head)
    tied = embed is not None and head is not None and head.module.weight is embed.module.weight
    if embed is not None:
        parallel_embed = VocabParallelEmbedding.from_serial(_serial(embed, nn.Embedding), axis)
        embed.replace(parallel_embed)
    if head is not None:
        parallel_head = ColumnParallelLinear.from_serial(_serial(head, nn.Linear), axis, **column)
        if tied:
            parallel_head.weight = parallel_embed.weight  # the same contiguous vocabulary rows
        head.replace(parallel_head)
        criterion = plan.outside(model, plan.criterion)
        criterion.replace(VocabParallelCrossEntropy.from_serial(criterion.module, axis, head.module.out_features))


def _parallelize_sequence_region(model: nn.Module, plan: ParallelPlan, axis: AxisGroup, shards: SequenceShards) -> None:
    """Sequence-parallel norms and per-shard dropouts inside the region; the markers as split/gather."""
    final = [part for path in plan.norms if (part := plan.outside(model, path)) is not None]
    for part in [*plan.in_blocks(model, "norms"), *final]:
        if not isinstance(part.module, SequenceParallelNorm):
            part.replace(SequenceParallelNorm.from_serial(_sequence_norm(part), axis))
    for part in plan.in_blocks(model, "dropouts"):
        part.replace(per_shard(part.module, (axis,)))  # tokens are split over tp
    entries = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SequenceRegion) and child.kind != "output":  # 'output' is cp's
                region = ScatterSequence(axis, child.seq_dim, shards) if child.kind == "enter" else \
                    GatherSequence(axis, child.seq_dim, shards, child.feeds_matmul)
                setattr(parent, name, region)
                entries += child.kind == "enter"
    assert entries == 1, f"sequence parallelism needs exactly one 'enter' SequenceRegion, found {entries}"


def _sequence_norm(part: Part) -> nn.Module:
    """The declared norm when it is an nn.LayerNorm or nn.RMSNorm (the norms with a sequence-parallel version)."""
    if type(part.module) not in (nn.LayerNorm, nn.RMSNorm):
        raise ConfigError(f"{part.name} is a {type(part.module).__name__}, which has no sequence-parallel version",
                          "parallel.sequence_parallel", "set parallel.sequence_parallel=false, or use nn.LayerNorm")
    return part.module
