"""The contract between a model and parallelism: the model declares its parallel plan
(networks/parallel_plan.py), the tp and cp steps follow it and refuse what it leaves out.

- Without processes: each model's plan covers every linear, norm, dropout and attention inside its blocks
  and every weight outside them; the initial weights equal those of the former rule (linears named
  `attn.proj` / `mlp.fc2` scaled by 1/sqrt(2 x depth)); a row linear of another name is scaled because it is
  declared; a plan that names a missing module is refused.
- On 2 gloo ranks (tp2 and cp2 grids): an undeclared linear or attention core inside a block, or an
  undeclared weight outside the blocks, is refused with a one-line ConfigError naming it, under tp2 (with
  and without sequence parallelism) and cp2; an attention module of another class with other attribute
  names, declared in the plan, is parallelized and matches the serial model (output and every gradient).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed.context.parallelize import parallelize_context
from distributed.data_parallel import sync_partial_grads
from distributed.tensor.parallelize import parallelize
from networks.blocks import Attention, ScaledDotProductAttention
from networks.initialization import initialize
from networks.parallel_plan import BLOCK, check_followed
from networks.transformer import GPT, GPTConfig
from networks.vit.model import ViT, ViTConfig
from tests.helpers import run_ranks
from tests.test_parallelize import _compare_grads
from utils import ConfigError
from utils.comm import init_grid
from utils.schema import ParallelConfig

EMBED, DEPTH = 32, 2


def vit(cls: type[ViT] = ViT) -> ViT:
    torch.manual_seed(0)
    return cls(ViTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, patch_size=4), (8, 16), 3, 3).double()


def gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(embed_dim=EMBED, depth=DEPTH, num_heads=4, max_positions=16, **overrides)
    return GPT(cfg, vocab_size=50).double()


MODELS = {"vit": vit, "gpt": gpt, "gpt_rotary_untied": lambda: gpt(positions="rotary", tie_embeddings=False)}


@pytest.mark.parametrize("name", MODELS)
def test_plan_covers_every_layer_in_the_blocks(name):
    model = MODELS[name]()
    plan = model.parallel_plan()
    b = plan.block
    declared = {nn.Linear: b.column + b.row, nn.LayerNorm: b.norms, nn.Dropout: b.dropouts, Attention: b.attention}
    assert not set(b.column) & set(b.row)
    for _, block in plan.blocks(model):
        for kind, paths in declared.items():
            present = sorted(path for path, m in block.named_modules() if isinstance(m, kind))
            assert present == sorted(paths), (name, kind, present)
        cores = {path for path, m in block.named_modules() if isinstance(m, ScaledDotProductAttention)}
        assert cores == {f"{path}.attend" for path in plan.block.attention}
    assert plan.pipeline_ends == type(model).PIPELINE_ENDS
    check_followed(model, plan, "parallel.tp=2")  # every weight outside the blocks is declared too


class RenamedAttention(nn.Module):
    """Another attention class (not networks.blocks.Attention) with other names for its projections: its
    fused `wqkv` keeps the (head, {q,k,v}, head_dim) order, `wo` projects back into the residual stream."""

    def __init__(self, serial: Attention):
        super().__init__()
        self.num_heads, self.head_dim, self.positions = serial.num_heads, serial.head_dim, None
        self.wqkv, self.attend, self.wo = serial.qkv, serial.attend, serial.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x).unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)  # (3, B, h, N, hd)
        return self.wo(self.attend(*qkv.unbind(0)).transpose(1, 2).flatten(2))  # (B, N, C)


def renamed_vit() -> ViT:
    """The ViT with RenamedAttention in its blocks (the same weights), declared in its plan."""
    model = vit()
    plan = model.parallel_plan()
    plan = dataclasses.replace(plan, block=dataclasses.replace(plan.block, column=("attn.wqkv", "mlp.fc1"),
                                                               row=("attn.wo", "mlp.fc2")))
    for block in model.blocks:
        block.attn = RenamedAttention(block.attn)
    model.parallel_plan = lambda: plan
    return model


def test_residual_projections_follow_the_plan():
    """The init scales the declared row linears, whatever their names (`attn.wo` here)."""
    model = renamed_vit()
    residual = model.parallel_plan().residual_projections(model)
    assert residual == [m for b in model.blocks for m in (b.attn.wo, b.mlp.fc2)]
    model.cfg = dataclasses.replace(model.cfg, init_std=1.0, depth=50)  # the scale 1/sqrt(2 x 50) = 0.1
    initialize(model, seed=0)  # from the model's own init_rules(), which read the plan
    for block in model.blocks:  # std 1/sqrt(2 x 50) = 0.1 against 1 (truncated at +-2)
        assert block.attn.wo.weight.std() < 0.2 < 0.8 < block.attn.wqkv.weight.std()


def test_a_plan_naming_a_missing_module_is_refused():
    model = vit()
    plan = dataclasses.replace(model.parallel_plan(), block=dataclasses.replace(BLOCK, row=("attn.proj", "mlp.fc9")))
    with pytest.raises(ConfigError, match=r"declares blocks\.0\.mlp\.fc9, which the model does not have"):
        list(plan.in_blocks(model, "row"))


class ExtraLinearViT(ViT):
    """A block with an undeclared linear (the review's `mlp.fc3`)."""

    def __init__(self, *args):
        super().__init__(*args)
        for block in self.blocks:
            block.mlp.fc3 = nn.Linear(EMBED, EMBED).double()


class ExtraCoreViT(ViT):
    """A block with an undeclared (parameter-free) attention core."""

    def __init__(self, *args):
        super().__init__(*args)
        for block in self.blocks:
            block.cross = ScaledDotProductAttention(causal=False, dropout=0.0)


class ExtraHeadViT(ViT):
    """An undeclared weight outside the blocks."""

    def __init__(self, *args):
        super().__init__(*args)
        self.extra_head = nn.Linear(EMBED, EMBED).double()


def _refused(model: nn.Module, grid, cp: bool, sp: bool, want: str) -> None:
    with pytest.raises(ConfigError) as err:
        if cp:
            parallelize_context(model, grid=grid, variant="allgather")
        else:
            parallelize(model, grid=grid, sequence_parallel=sp)
    line, setting = err.value.line(), "parallel.cp" if cp else "parallel.tp"
    assert "\n" not in line and line.startswith(f"error: {want} ") and err.value.setting == setting, line
    assert f"is not declared in {type(model).__name__}.parallel_plan(), so {setting}=2 would leave it serial" in line


def _matches_serial(model: nn.Module, grid, cp: bool, sp: bool = True) -> None:
    """Output and every weight gradient (summed over cp, as the data-parallel reduction does) equal serial."""
    parallel = copy.deepcopy(model)
    parallel = parallelize_context(parallel, grid=grid, variant="allgather") if cp else \
        parallelize(parallel, grid=grid, sequence_parallel=sp)
    x = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y_ref, y = model(x), parallel(x)
    torch.testing.assert_close(y, y_ref)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    sync_partial_grads(parallel)
    for p in parallel.parameters() if cp else ():
        dist.all_reduce(p.grad, group=grid.axis("cp").group)
    _compare_grads(model, parallel, grid.axis("tp"))


class ScaleNorm(nn.Module):
    """A per-token norm of a class without a sequence-parallel version (Nguyen and Salazar 2019)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight / x.norm(dim=-1, keepdim=True)


def _norm_vit(kind: type[nn.Module]) -> ViT:
    model = vit()
    for block in model.blocks:
        block.norm1 = kind(EMBED).double()  # declared (BLOCK's norms)
    return model


def _contract_checks(rank: int, world_size: int) -> None:
    for cp in (False, True):
        grid = init_grid(ParallelConfig(cp=2) if cp else ParallelConfig(tp=2))
        for sp in (False, True):
            _refused(vit(ExtraLinearViT), grid, cp, sp, "blocks.0.mlp.fc3 (Linear)")
        _refused(vit(ExtraCoreViT), grid, cp, True, "blocks.0.cross (ScaledDotProductAttention)")
        _refused(vit(ExtraHeadViT), grid, cp, True, "extra_head (Linear)")
        _matches_serial(renamed_vit(), grid, cp)
    tp = init_grid(ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match=r"^blocks\.0\.norm1 is a ScaleNorm, which has no sequence-parallel version"):
        parallelize(_norm_vit(ScaleNorm), grid=tp, sequence_parallel=True)
    _matches_serial(_norm_vit(ScaleNorm), tp, cp=False, sp=False)  # a serial norm on whole sequences: accepted
    _matches_serial(_norm_vit(nn.RMSNorm), tp, cp=False, sp=True)  # Llama's norm on sequence shards


def test_undeclared_layers_are_refused_and_declared_ones_parallelized(tmp_path):
    run_ranks(_contract_checks, 2, tmp_path)
