"""Context parallelism through `parallelize_context` (distributed/context/): the balancer, and models
whose sequence is split over cp (alone and with tp) equal the serial model in output, loss, every weight
gradient and greedy decoding, for every attention variant, in fp64 on gloo; a compiled cp block
equals the eager one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed.context.layout import chunk_positions
from distributed.context.parallelize import parallelize_context
from distributed.data_parallel import sync_partial_grads
from distributed.tensor.parallelize import parallelize
from networks.transformer import GPT, GPTConfig
from networks.vit.model import ViT, ViTConfig
from tests.helpers import run_ranks
from tests.test_parallelize import _compare_grads
from utils.comm import init_grid
from utils.language.task.generate import greedy_decode
from utils.schema import ParallelConfig

BATCH, EMBED, DEPTH = 2, 32, 2


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_balanced_layout_is_a_permutation_with_equal_causal_work(cp):
    length = 2 * cp * 5
    positions = chunk_positions(length, cp, balanced=True)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(length))  # unshard(shard) = identity
    keys = torch.arange(length)
    pairs = {int((p[:, None] >= keys[None, :]).sum()) for p in positions}  # unmasked query-key pairs
    assert len(pairs) == 1, pairs
    contiguous = chunk_positions(4050, 4, balanced=False)
    assert [len(p) for p in contiguous] == [1013, 1013, 1012, 1012]


def _vit() -> ViT:
    torch.manual_seed(0)
    cfg = ViTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, patch_size=4)
    return ViT(cfg, (12, 20), 3, 3).double()  # 15 patches: uneven over cp 2 and 4


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, max_positions=32), vocab_size=50).double()


def _parallel(serial: nn.Module, grid, variant: str, sp: bool) -> nn.Module:
    model = parallelize(copy.deepcopy(serial), grid=grid, sequence_parallel=sp)
    return parallelize_context(model, grid=grid, variant=variant)


def _backward_and_compare(serial: nn.Module, parallel: nn.Module, loss_ref, loss, grid) -> None:
    """Equal losses; after what the data-parallel reduction does with cp (sum every gradient over cp,
    after tp's partial sync), every weight gradient equals the serial one."""
    torch.testing.assert_close(loss, loss_ref)
    loss_ref.backward()
    loss.backward()
    sync_partial_grads(parallel)
    for p in parallel.parameters():
        dist.all_reduce(p.grad, group=grid.axis("cp").group)
    _compare_grads(serial, parallel, grid.axis("tp"))


def _check_vit(grid, variant: str, sp: bool) -> None:
    serial = _vit()
    parallel = _parallel(serial, grid, variant, sp)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 12, 20, generator=gen, dtype=torch.float64)
    y_ref, y = serial(x), parallel(x)
    torch.testing.assert_close(y, y_ref)
    _backward_and_compare(serial, parallel, serial.criterion(y_ref, x), parallel.criterion(y, x), grid)


def _check_gpt(grid, variant: str, sp: bool) -> None:
    serial = _gpt()
    parallel = _parallel(serial, grid, variant, sp)
    gen = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(0, 50, (BATCH, 16), generator=gen), torch.randint(0, 50, (BATCH, 16), generator=gen)
    _backward_and_compare(serial, parallel, serial.loss(idx, targets), parallel.loss(idx, targets), grid)
    prompts = torch.randint(0, 50, (2, 5), generator=gen)
    want = greedy_decode(serial, prompts, 6, tp=init_grid(ParallelConfig()).axis("tp"))
    assert torch.equal(greedy_decode(parallel, prompts, 6, tp=grid.axis("tp")), want)


def _check_compile(grid) -> None:
    """A cp block compiles: allgather and alltoall into one graph with no break, ring around the eager ring
    only; compiled outputs and gradients equal eager ones."""
    for variant in ("allgather", "ring", "alltoall"):
        model = _parallel(_gpt(), grid, variant, sp=True)
        shards, block = model.context_shards, model.blocks[0]
        shards.enter(16, torch.device("cpu"))
        full = torch.randn(BATCH, 16, EMBED, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        x = shards.shard(full, 1)
        explanation = torch._dynamo.explain(block)(x)
        if variant in ("allgather", "alltoall"):
            assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
        else:  # the only breaks are the eager ring's (one per frame it is nested in)
            assert all("_ring" in r.reason for r in explanation.break_reasons), explanation.break_reasons
        results = []
        for run in (block, torch.compile(block, backend="aot_eager")):
            xr = x.clone().requires_grad_(True)
            out = run(xr)
            grads = torch.autograd.grad(out.square().sum(), [xr, *block.parameters()])
            results.append((out, *grads))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)


def _check_dropout_streams(grid, sp: bool) -> None:
    """Dropout masks (allgather, dropout 0.5): two ranks of the tp x cp group draw the same mask exactly
    where the activation is replicated between them: the embedding's everywhere, the residual/MLP ones
    across tp without sequence parallelism; and the attention cores fork over (tp, cp)."""
    group, tp, cp = grid.axis("tp", "cp"), grid.axis("tp"), grid.axis("cp")
    torch.manual_seed(0)
    model = GPT(GPTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, max_positions=32, dropout=0.5), vocab_size=50)
    model = parallelize_context(parallelize(model, grid=grid, sequence_parallel=sp), grid=grid, variant="allgather")
    assert all(b.attn.attend.axes == (tp, cp) for b in model.blocks)
    masks: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(
                lambda m, args, out, name=name: masks.__setitem__(name, (out == 0) & (args[0] != 0)))
    torch.manual_seed(1)  # one default stream per replica, as utils.engine.build seeds it
    model.train().loss(torch.randint(0, 50, (BATCH, 16)), torch.randint(0, 50, (BATCH, 16)))
    for name, mask in masks.items():
        parts = [torch.empty_like(mask, dtype=torch.int32) for _ in range(group.size)]
        dist.all_gather(parts, mask.int(), group=group.group)
        mine = group.ranks.index(dist.get_rank())
        for other, rank in enumerate(group.ranks):
            same_cp_shard = rank in tp.ranks  # my tp group: the same cp coordinate
            want = "embed" in name or (not sp and same_cp_shard)
            if other != mine:
                assert torch.equal(parts[other], parts[mine]) == want, (name, rank, want)


def _context_checks(rank: int, world_size: int, tp: int) -> None:
    grid = init_grid(ParallelConfig(tp=tp, cp=world_size // tp))
    if world_size == 2:
        _check_compile(grid)
    if world_size == 2 or tp > 1:
        for sp in (False, True):
            _check_dropout_streams(grid, sp)
    for variant in ("allgather", "ring", "alltoall"):
        for sp in ((False, True) if tp > 1 else (True,)):
            _check_vit(grid, variant, sp)
            _check_gpt(grid, variant, sp)


@pytest.mark.parametrize("world_size,tp", [(2, 1), (4, 1), (4, 2)])
def test_context_parallel_models_match_serial(world_size, tp, tmp_path):
    run_ranks(_context_checks, world_size, tmp_path, tp, timeout_s=180)
