"""The parallel plan: the parts of a model that tensor, sequence, context and pipeline parallelism act on.

A model returns its `ParallelPlan` from `parallel_plan()`. `distributed.tensor.parallelize` and
`distributed.context.parallelize` swap exactly the modules it names and then call `check_followed`,
which refuses (one-line ConfigError) a model with weights or an attention core inside its blocks that the
plan does not declare: such a layer would stay serial, attend to this rank's tokens only or train on
partial gradients. The swaps find nothing by class or attribute name; a declared part's class only
chooses its parallel implementation (an nn.Linear has a column-parallel version, an RMSNorm has no
sequence-parallel one yet, and is refused under sequence parallelism).

Paths are module paths as `nn.Module.get_submodule` reads them: relative to each block for `BlockPlan`
(torchtitan applies its per-layer plan the same way), relative to the model elsewhere. `BLOCK` is the plan
of `networks.blocks.Block`, which the ViT and the GPT share.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from torch import nn

from networks.blocks import ScaledDotProductAttention
from utils import ConfigError


class AttentionModule(Protocol):
    """What parallelism needs of a declared attention module (`networks.blocks.Attention` is one).

    Its fused QKV projection `qkv` (declared column-parallel) orders its output features (kv group,
    [the group's q heads, k, v], head_dim), so a contiguous split over tp gives each rank whole groups
    when tp divides the groups; with more tp ranks than groups, tensor parallelism gives each rank its
    query heads and its group's key/value head (`GroupedQKVParallelLinear`) and lowers `q_per_group`.
    """

    num_heads: int  # heads of the serial module; tp must divide it
    # Grouped-query attention only (multi-head attention may leave them out):
    num_kv_heads: int  # key/value heads (groups) of the serial module
    q_per_group: int  # query heads per group that this module computes
    head_dim: int
    qkv: nn.Module
    attend: nn.Module  # the core on (B, h, N, head_dim) q, k, v, with `causal` and `dropout`: cp swaps it
    positions: object  # None, or (cp) the token layout whose `local_positions` rotary embeddings read


@dataclass(frozen=True)
class BlockPlan:
    """Roles of the modules inside one transformer block, as paths relative to the block.

    - attention: attention modules (AttentionModule): whole heads per tp rank, the core swapped by cp;
    - column: nn.Linear split by output features over tp (input replicated, or gathered under sp);
    - row: nn.Linear split by input features over tp. These are the projections back into the residual
      stream, whose initial std is scaled by 1/sqrt(2 x depth) (GPT-2; Megatron's output-layer init);
    - norms: per-token nn.LayerNorm, sequence-parallel under sp and serial (replicated) otherwise;
    - dropouts: nn.Dropout on per-token activations, drawing a mask per token shard under sp and cp.
    """

    attention: tuple[str, ...] = ()
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    dropouts: tuple[str, ...] = ()

    def weights(self) -> frozenset[str]:
        """Paths of the modules whose weights the plan accounts for."""
        return frozenset(self.column + self.row + self.norms)


@dataclass(frozen=True)
class ParallelPlan:
    """Everything parallelism needs to know about a model, declared by the model (paths below the model).

    - block: the roles inside every entry of `blocks` (an nn.ModuleList; on a pipeline rank an
      nn.ModuleDict of its blocks by global index);
    - norms: per-token norms after the blocks, inside the sequence region (the final norm), as block norms;
    - replicated: weights outside the blocks that stay whole and serial on every rank: they run before the
      sequence split or per token after it (patch and position embeddings, the ViT's head);
    - vocab_embedding: the token embedding, its rows (the vocabulary) split over tp;
    - vocab_head: the head over the vocabulary, column-parallel over tp with the logits left split; a tie
      to `vocab_embedding` is kept;
    - criterion: the loss; vocab-parallel with `vocab_head`, and under cp averaged over the ranks' tokens
      when no 'output' SequenceRegion gathers them before it;
    - pipeline_ends: the first and last stage's method -> the attributes it uses (`PIPELINE_ENDS`).
    """

    block: BlockPlan
    norms: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    vocab_embedding: str | None = None
    vocab_head: str | None = None
    criterion: str = "criterion"
    pipeline_ends: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def blocks(self, model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """(global name, block) of every block `model` holds (a pipeline rank: its own, by global index)."""
        for name, block in model.blocks.named_children():
            yield f"blocks.{name}", block

    def in_blocks(self, model: nn.Module, role: str) -> Iterator[Part]:
        """Every module of `role` (a BlockPlan field) in `model`'s blocks."""
        for name, block in self.blocks(model):
            for path in getattr(self.block, role):
                if (module := _module_at(model, block, path, f"{name}.{path}")) is not None:
                    yield Part(block, path, f"{name}.{path}", module)

    def outside(self, model: nn.Module, path: str | None) -> Part | None:
        """The declared part at `path` of `model` outside the blocks; None when the plan names none or this
        model holds none there (an option, like rotary instead of a position table; a pipeline rank's ends)."""
        module = None if path is None else _module_at(model, model, path, path)
        return None if module is None else Part(model, path, path, module)

    def residual_projections(self, model: nn.Module) -> list[nn.Module]:
        """The row-role linears of every block: the ones whose initial std is scaled by 1/sqrt(2 x depth)."""
        return [part.module for part in self.in_blocks(model, "row")]


class Part(NamedTuple):
    """A declared module: `module` at `path` below `root` (a block, or the model), `name` its global path."""

    root: nn.Module
    path: str
    name: str
    module: nn.Module

    def replace(self, module: nn.Module) -> None:
        """Put `module` in its place in the model."""
        parent, _, leaf = self.path.rpartition(".")
        setattr(self.root.get_submodule(parent), leaf, module)


class ParallelModel(Protocol):
    """A model parallelism can act on: its blocks and its declaration of them."""

    blocks: nn.Module  # nn.ModuleList of blocks (an nn.ModuleDict by global index once cut for a pipeline rank)

    def parallel_plan(self) -> ParallelPlan: ...


def _module_at(model: nn.Module, root: nn.Module, path: str, name: str) -> nn.Module | None:
    """The module at `path` below `root` (None where the model holds None); `name` is its global path."""
    module = root
    for attr in path.split("."):
        if not hasattr(module, attr):
            raise ConfigError(f"{type(model).__name__}.parallel_plan() declares {name}, which the model does not have",
                              "model", "declare only modules the model holds")
        module = getattr(module, attr)
        if module is None:
            return None
    return module


def check_followed(model: nn.Module, plan: ParallelPlan, setting: str) -> None:
    """Refuse a model whose plan leaves out a part that the parallelism `setting` (e.g. 'parallel.tp=2') needs
    to know: weights inside the blocks not owned by a declared column, row or norm; an attention core inside
    the blocks that is not the core of a declared attention; weights outside the blocks not declared at all.

    Attention cores are recognised by the serial core of networks/blocks.py (and torch's MultiheadAttention
    holds weights of its own): a core of another class, inside a declared module, is beyond this check.
    """
    model_name = type(model).__name__
    for name, block in plan.blocks(model):
        for param_name, _ in block.named_parameters():
            owner = param_name.rpartition(".")[0]
            if owner not in plan.block.weights():
                _refuse(model_name, f"{name}.{owner or param_name}", type(block.get_submodule(owner)).__name__, setting)
    # The cores of the declared attention modules (inside tp's dropout-stream wrapper, if any).
    cores = {id(m) for part in plan.in_blocks(model, "attention") for m in part.module.attend.modules()}
    for name, block in plan.blocks(model):
        for path, module in block.named_modules():
            if isinstance(module, ScaledDotProductAttention) and id(module) not in cores:
                _refuse(model_name, f"{name}.{path}", type(module).__name__, setting)
    declared = set(plan.norms + plan.replicated) | {plan.vocab_embedding, plan.vocab_head}
    for param_name, _ in model.named_parameters():
        owner = param_name.rpartition(".")[0]
        if not param_name.startswith("blocks.") and param_name not in declared and owner not in declared:
            _refuse(model_name, owner or param_name, type(model.get_submodule(owner)).__name__, setting)


def _refuse(model_name: str, path: str, kind: str, setting: str) -> None:
    axis = setting.partition("=")[0]
    raise ConfigError(f"{path} ({kind}) is not declared in {model_name}.parallel_plan(), so {setting} would leave it "
                      "serial", axis, f"declare its role in the model's parallel_plan(), or set {axis}=1")


# The roles inside networks.blocks.Block.
BLOCK = BlockPlan(attention=("attn",), column=("attn.qkv", "mlp.fc1"), row=("attn.proj", "mlp.fc2"),
                  norms=("norm1", "norm2"), dropouts=("drop", "mlp.drop"))
