"""Dropout streams on sharded activations (distributed/rng.py).

Single process, with one AxisGroup per pretend rank (the streams never communicate): shards draw
different masks, the default stream stays in agreement, activation checkpointing's recompute draws
the same masks. The multi-rank check through `parallelize` is `_check_dropout_streams` in
tests/test_parallelize.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from distributed.rng import ShardedRandom, coordinate, per_shard, sharded_stream
from networks.blocks import Block, ScaledDotProductAttention
from utils.comm import AxisGroup


def tp(rank: int, size: int = 2) -> AxisGroup:
    return AxisGroup("tp", size, rank)


def _mask_on(rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask drawn by `rank`'s shard, the next default-stream draw afterwards) from a fresh seed."""
    torch.manual_seed(seed)
    with sharded_stream((tp(rank),)):
        mask = torch.rand(64) < 0.5
    return mask, torch.rand(4)


def test_shards_differ_and_the_default_stream_agrees():
    (m0, after0), (m1, after1) = _mask_on(0), _mask_on(1)
    assert not torch.equal(m0, m1)  # each shard its own mask
    torch.testing.assert_close(after0, after1, rtol=0, atol=0)  # the replicated stream still agrees
    torch.testing.assert_close(_mask_on(1)[0], m1, rtol=0, atol=0)  # reproducible from the seed
    assert not torch.equal(_mask_on(1, seed=1)[0], m1)  # and follows it
    torch.manual_seed(0)
    torch.randint(2**48, ())  # the fork costs the default stream exactly one draw of a key
    torch.testing.assert_close(torch.rand(4), after0, rtol=0, atol=0)


def test_coordinate_numbers_every_shard_once():
    seen = {coordinate((tp(a, 2), tp(b, 3))) for a in range(2) for b in range(3)}
    assert seen == {(i, 6) for i in range(6)}


def test_per_shard_wraps_only_random_sharded_modules():
    drop, core = nn.Dropout(0.1), ScaledDotProductAttention(causal=True, dropout=0.1)
    assert isinstance(per_shard(drop, (tp(0),)), ShardedRandom)
    assert isinstance(per_shard(core, (tp(0),)), ShardedRandom)
    assert per_shard(nn.Dropout(0.0), (tp(0),)).__class__ is nn.Dropout  # nothing random: untouched
    assert per_shard(drop, (tp(0, size=1),)) is drop  # not sharded
    wrapped = per_shard(drop, (tp(0),))
    assert per_shard(wrapped, (tp(0),)) is wrapped  # never twice


def test_attention_core_masks_differ_per_shard():
    q, k, v = torch.randn(3, 1, 2, 16, 8, dtype=torch.float64).unbind(0)
    outs = []
    for rank in (0, 1, 1):
        core = ShardedRandom(ScaledDotProductAttention(causal=False, dropout=0.5), (tp(rank),))
        torch.manual_seed(0)
        outs.append(core(q, k, v))
    assert not torch.allclose(outs[0], outs[1])
    torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=0)
    core.eval()  # no dropout, no fork: the default stream is not touched
    torch.manual_seed(0)
    core(q, k, v)
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.testing.assert_close(torch.rand(3), after, rtol=0, atol=0)


def _block_grads(checkpointed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    block = Block(16, 2, dropout=0.3).double()
    block.attn.attend = per_shard(block.attn.attend, (tp(1),))
    block.drop, block.mlp.drop = per_shard(block.drop, (tp(1),)), per_shard(block.mlp.drop, (tp(1),))
    module = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT) if checkpointed else block
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    module(x).square().sum().backward()
    return {"x": x.grad, **{name: p.grad for name, p in block.named_parameters()}}


def test_activation_checkpointing_recomputes_the_same_masks():
    plain, recomputed = _block_grads(False), _block_grads(True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=0, msg=name)
