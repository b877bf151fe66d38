"""Tensor (and sequence) parallelism for a serial model: swap its layers in place for parallel ones.

`parallelize(model, grid=grid, sequence_parallel=...)` shards, over the grid's tp axis:
- every `networks.blocks.Attention`: `qkv` column-parallel (whole heads per rank, because its output
  features are ordered (head, {q,k,v}, head_dim)), `proj` row-parallel;
- every `networks.blocks.MLP`: `fc1` column-parallel, `fc2` row-parallel;
- the language model convention (`networks/transformer.py`): `tok_embed` vocab-parallel, `lm_head`
  column-parallel over the vocabulary without gathering (still tied to `tok_embed` when it was),
  `criterion` the vocab-parallel cross-entropy;
- under sequence parallelism (Korthikanti et al. 2022): the LayerNorms inside the sequence region
  (blocks' `norm1`/`norm2`, the model's final `norm`) become sequence-parallel, the `SequenceRegion`
  markers split ('enter') and gather ('exit') the sequence over tp, and the linears all-gather /
  reduce-scatter along the sequence instead of all-reduce. Without it the regions stay identities.
- dropout on sharded activations draws a mask per shard (`distributed.rng`): the attention core's
  (heads are split) always, the blocks' residual and MLP dropouts under sequence parallelism (tokens
  are split). Dropouts on replicated activations (the embeddings', and the blocks' without sequence
  parallelism) keep the default stream, which agrees across tp, so every rank applies the same mask.

Weights are copied shard by shard from the serial model (`from_serial`), so the full weights of a
parallel model equal the serial ones. Per block and training step the blocks move 8(t-1)/t x A bytes
on tp (A = batch x tokens x hidden x bytes per element of the matmuls: 4 in fp32, 2 under bf16/fp16
autocast, since column-parallel inputs are cast before they are communicated) without sequence
parallelism, and 10(t-1)/t x A with it (the two column-parallel layers all-gather their input again in
backward; 8(t-1)/t x A with `keep_gathered`).
"""

from __future__ import annotations

from torch import nn

from distributed.rng import per_shard
from distributed.tensor.layers import (ColumnParallelLinear, GatherSequence, RowParallelLinear, ScatterSequence,
                                       SequenceParallelLayerNorm, SequenceShards)
from distributed.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from networks.blocks import MLP, Attention, Block, SequenceRegion
from utils.comm import Axis, AxisGroup, Grid


def parallelize(model: nn.Module, *, grid: Grid, sequence_parallel: bool, keep_gathered: bool = False) -> nn.Module:
    """Shard `model` over grid's tp axis in place and return it (unchanged at tp == 1). `keep_gathered`:
    column-parallel layers under sequence parallelism save their gathered input, not their shard.

    tp must divide every attention layer's head count (a user setting checked by utils.config.Config).
    """
    axis = grid.axis(Axis.TP)
    if axis.size == 1:
        return model
    heads = [m.qkv.out_features // (3 * m.head_dim) for m in model.modules() if isinstance(m, Attention)]
    assert all(h % axis.size == 0 for h in heads), f"heads {heads} cannot be split over tp={axis.size}"
    shards = SequenceShards(axis)
    column = dict(sequence_parallel=sequence_parallel, shards=shards, keep_gathered=keep_gathered)
    _parallelize_vocab(model, axis, column)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.qkv = ColumnParallelLinear.from_serial(module.qkv, axis, **column)
            module.proj = RowParallelLinear.from_serial(module.proj, axis, sequence_parallel=sequence_parallel)
            module.attend = per_shard(module.attend, (axis,))  # heads are split over tp
        elif isinstance(module, MLP):
            module.fc1 = ColumnParallelLinear.from_serial(module.fc1, axis, **column)
            module.fc2 = RowParallelLinear.from_serial(module.fc2, axis, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        _parallelize_sequence_region(model, axis, shards)
    return model


def _parallelize_vocab(model: nn.Module, axis: AxisGroup, column: dict) -> None:
    """Language models: vocab-parallel tok_embed, lm_head (tie kept) and criterion.

    The embedding all-reduces (no sequence split of its own) because positions are added and the
    sequence is split afterwards, at the model's 'enter' region. The head reads the sequence-parallel
    layout of the final norm and all-gathers it, so logits are (B, S, V_local) with replicated targets.
    """
    embed, head = getattr(model, "tok_embed", None), getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if isinstance(embed, nn.Embedding):
        model.tok_embed = VocabParallelEmbedding.from_serial(embed, axis)
    if isinstance(head, nn.Linear):
        model.lm_head = ColumnParallelLinear.from_serial(head, axis, **column)
        if tied:
            model.lm_head.weight = model.tok_embed.weight  # the same contiguous vocabulary rows
        if isinstance(getattr(model, "criterion", None), nn.Module):
            model.criterion = VocabParallelCrossEntropy.from_serial(model.criterion, axis, head.out_features)


def _parallelize_sequence_region(model: nn.Module, axis: AxisGroup, shards: SequenceShards) -> None:
    """Sequence-parallel LayerNorms and per-shard dropouts inside the region; the markers as split/gather."""
    for module in list(model.modules()):
        if isinstance(module, Block):
            module.norm1 = SequenceParallelLayerNorm.from_serial(module.norm1, axis)
            module.norm2 = SequenceParallelLayerNorm.from_serial(module.norm2, axis)
            module.drop = per_shard(module.drop, (axis,))  # tokens are split over tp
        elif isinstance(module, MLP):
            module.drop = per_shard(module.drop, (axis,))
    norm = getattr(model, "norm", None)
    if isinstance(norm, nn.LayerNorm) and not isinstance(norm, SequenceParallelLayerNorm):
        model.norm = SequenceParallelLayerNorm.from_serial(norm, axis)
    entries = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SequenceRegion) and child.kind != "output":  # 'output' is cp's
                region = ScatterSequence(axis, child.seq_dim, shards) if child.kind == "enter" else \
                    GatherSequence(axis, child.seq_dim, shards, child.feeds_matmul)
                setattr(parent, name, region)
                entries += child.kind == "enter"
    assert entries == 1, f"sequence parallelism needs exactly one 'enter' SequenceRegion, found {entries}"
