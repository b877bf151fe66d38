"""Each parallel layer against its serial twin on identical full weights, on 2 and 4 gloo ranks.

Compared: the output, the input gradient and every weight gradient (a sharded weight's gradient
against the matching shard of the serial gradient; replicated weights with partial gradients after
`sync_partial_grads`), with and without sequence parallelism, with uneven splits (7 tokens, 10 output
features, an 18-row vocabulary of which 13 are real). Float64, so comparisons are tight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed.data_parallel import sync_partial_grads
from distributed.tensor.layers import (
    ColumnParallelLinear,
    GroupedQKVParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceShards,
    shard,
)
from distributed.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from networks.transformer import CausalLMLoss
from tests.helpers import run_ranks
from utils.comm import Grid, init_grid
from utils.schema import ParallelConfig

B, N, D_IN, D_OUT, VOCAB, VALID = 2, 7, 6, 10, 18, 13
close = torch.testing.assert_close


def _randn(*shape, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _serial_linear(in_f: int, out_f: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, dtype=torch.float64)


def _serial_run(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor):
    """Serial output, input gradient and parameter gradients for `cotangent`."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(cotangent)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _parallel_run(module: nn.Module, x: torch.Tensor, cotangent_of, grid=None):
    """Parallel output and input gradient; cotangent_of(y) picks this rank's cotangent for y."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(cotangent_of(y))
    if grid is not None:
        sync_partial_grads(module)
    return y.detach(), x.grad


def _check_column(axis, sp: bool, gather: bool) -> None:
    serial = _serial_linear(D_IN, D_OUT, seed=1)
    x, g = _randn(B, N, D_IN, seed=2), _randn(B, N, D_OUT, seed=3)
    y_ref, dx_ref, dw_ref = _serial_run(serial, x, g)
    shards = SequenceShards(axis)
    shards.enter(N)
    layer = ColumnParallelLinear.from_serial(serial, axis, sequence_parallel=sp, gather_output=gather, shards=shards)
    x_in = shard(x, axis, 1) if sp else x
    y, dx = _parallel_run(layer, x_in, lambda _: g if gather else shard(g, axis, -1))
    close(y, y_ref if gather else shard(y_ref, axis, -1))
    close(dx, shard(dx_ref, axis, 1) if sp else dx_ref)
    close(layer.weight.grad, shard(dw_ref["weight"], axis, 0))
    close(layer.bias.grad, shard(dw_ref["bias"], axis, 0))


def _check_row(grid, axis, sp: bool, input_is_parallel: bool) -> None:
    serial = _serial_linear(D_OUT, D_IN, seed=4)  # in features 10: uneven over 4 ranks
    x, g = _randn(B, N, D_OUT, seed=5), _randn(B, N, D_IN, seed=6)
    y_ref, dx_ref, dw_ref = _serial_run(serial, x, g)
    layer = RowParallelLinear.from_serial(serial, axis, sequence_parallel=sp, input_is_parallel=input_is_parallel)
    x_in = shard(x, axis, -1) if input_is_parallel else x
    y, dx = _parallel_run(layer, x_in, lambda _: shard(g, axis, 1) if sp else g, grid)
    close(y, shard(y_ref, axis, 1) if sp else y_ref)
    close(dx, shard(dx_ref, axis, -1) if input_is_parallel else dx_ref)
    close(layer.weight.grad, shard(dw_ref["weight"], axis, 1))
    close(layer.bias.grad, dw_ref["bias"])  # partial under SP until sync_partial_grads
    assert layer.sharded_params == ("weight",) and layer.partial_grad_axes == ((axis,) if sp else ())


def _check_grouped_qkv(grid, axis, sp: bool) -> None:
    """Grouped-query QKV with one key/value group over every tp rank: each rank computes its query heads' rows
    and the group's k and v rows; its cotangent on those k, v rows is its part (1/tp here) of the serial one, as
    attention over its own heads gives it. After the partial-gradient sum every rank holds the serial gradient."""
    heads, head_dim = 4, 2  # one group: 4 query heads, then k and v
    serial = _serial_linear(D_IN, (heads + 2) * head_dim, seed=16)
    x, g = _randn(B, N, D_IN, seed=17), _randn(B, N, (heads + 2) * head_dim, seed=18)
    y_ref, dx_ref, dw_ref = _serial_run(serial, x, g)
    shards = SequenceShards(axis)
    shards.enter(N)
    layer = GroupedQKVParallelLinear(serial, axis, 1, heads, head_dim, sequence_parallel=sp, shards=shards)
    assert layer.q_local == heads // axis.size and len(layer.rows) == (layer.q_local + 2) * head_dim
    kv = torch.arange(len(layer.rows)) >= layer.q_local * head_dim
    cotangent = torch.where(kv, g[..., layer.rows] / axis.size, g[..., layer.rows])
    y, dx = _parallel_run(layer, shard(x, axis, 1) if sp else x, lambda _: cotangent, grid)
    close(y, y_ref[..., layer.rows])
    close(dx, shard(dx_ref, axis, 1) if sp else dx_ref)
    close(layer.weight.grad, dw_ref["weight"])
    close(layer.bias.grad, dw_ref["bias"])


def _check_layer_norm(grid, axis) -> None:
    serial = nn.LayerNorm(D_IN, dtype=torch.float64)
    with torch.no_grad():  # non-trivial affine weights
        serial.weight.copy_(_randn(D_IN, seed=7))
        serial.bias.copy_(_randn(D_IN, seed=8))
    x, g = _randn(B, N, D_IN, seed=9), _randn(B, N, D_IN, seed=10)
    y_ref, dx_ref, dw_ref = _serial_run(serial, x, g)
    layer = SequenceParallelLayerNorm.from_serial(serial, axis)
    y, dx = _parallel_run(layer, shard(x, axis, 1), lambda _: shard(g, axis, 1), grid)
    close(y, shard(y_ref, axis, 1))
    close(dx, shard(dx_ref, axis, 1))
    close(layer.weight.grad, dw_ref["weight"])
    close(layer.bias.grad, dw_ref["bias"])


def _check_embedding(axis, sp: bool) -> None:
    torch.manual_seed(11)
    serial = nn.Embedding(VOCAB, D_IN, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(12))
    g = _randn(B, N, D_IN, seed=13)
    y_ref = serial(ids)
    y_ref.backward(g)
    layer = VocabParallelEmbedding.from_serial(serial, axis, sequence_parallel=sp)
    y = layer(ids)
    y.backward(shard(g, axis, 1) if sp else g)
    close(y, shard(y_ref, axis, 1) if sp else y_ref.detach())
    close(layer.weight.grad, shard(serial.weight.grad, axis, 0))


def _check_cross_entropy(axis, offset: float = 0.0) -> None:
    """`offset` = 200: exp() of fp32 logits that large overflows unless the global max is subtracted."""
    logits = _randn(B, N, VOCAB, seed=14) + offset
    targets = torch.randint(0, VALID, (B, N), generator=torch.Generator().manual_seed(15))
    targets[0, 2] = -100  # ignored token
    serial = CausalLMLoss(VALID)
    full = logits.clone().requires_grad_(True)
    loss_ref = serial(full, targets)
    loss_ref.backward()
    criterion = VocabParallelCrossEntropy.from_serial(serial, axis, VOCAB)
    local = shard(logits, axis, -1).requires_grad_(True)
    loss = criterion(local, targets)
    loss.backward()
    close(loss, loss_ref)
    close(local.grad, shard(full.grad, axis, -1))


def _layer_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    axis = grid.axis("tp")
    for sp in (False, True):
        for gather in (False, True):
            _check_column(axis, sp, gather)
        for input_is_parallel in (True, False):
            _check_row(grid, axis, sp, input_is_parallel)
        _check_embedding(axis, sp)
        _check_grouped_qkv(grid, axis, sp)
    _check_layer_norm(grid, axis)
    for offset in (0.0, 200.0):
        _check_cross_entropy(axis, offset)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_layers_match_serial(world_size, tmp_path):
    run_ranks(_layer_checks, world_size, tmp_path)


@pytest.mark.parametrize("offset", [0.0, 200.0, -200.0])
def test_vocab_cross_entropy_of_large_logits_matches_torch(offset):
    """One rank, against F.cross_entropy directly: logits of +-200 overflow fp32 exp() without the max shift."""
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(7)) + offset
    targets = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(8))
    criterion = VocabParallelCrossEntropy(Grid.serial().axis("tp"), VOCAB)
    local = logits.clone().requires_grad_(True)
    loss = criterion(local, targets)
    loss.backward()
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    ref.backward()
    assert torch.isfinite(loss)
    close(loss, ref)
    close(local.grad, full.grad)
