"""Initial weights that depend on the seed and the parameter's name only, computable shard by shard.

A model declares how each parameter starts (`init_rules()`: single-process name -> `Init`). The values of a
parameter are drawn in fixed blocks of rows of its FULL tensor, block b from its own generator seeded by
(seed, the parameter's key, b), so any piece of the tensor is computed by drawing only the blocks its rows
overlap: a tensor-parallel, FSDP or pipeline rank computes exactly its shard without the full model ever
existing, and the full weights are the same under every layout (the layout invariance of the README's
"Parallel layouts"). A piece that splits columns draws whole rows and keeps its columns: the bound is one
block, not one tensor.

    full tensor (R rows)      block 0 rows [0, B)  block 1 [B, 2B) ...   B = max(1, BLOCK_ELEMENTS // row size)
    a rank's piece            rows [r0, r1) x columns [c0, c1) x ...: draws blocks r0 // B .. (r1 - 1) // B

B depends on the tensor's row size only and a block draws its real rows only (the vocabulary padding's rows
are zeros, not drawn), so a padded vocabulary changes no real row. (torch's normal_ on the CPU fills 16
values at a time, each draw's last values depending on its length: the draw's shape must not vary.)
Distributions are the models' own: normal, truncated normal on [-2 std, 2 std] (GPT-2, the ViT), ones, zeros.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

BLOCK_ELEMENTS = 1 << 18  # elements of one drawn block (1 MiB in float32): the most a piece draws beyond itself
KINDS = ("normal", "trunc_normal", "zeros", "ones")


@dataclass(frozen=True)
class Init:
    """How one parameter starts. `valid_rows`: rows from there on are zero (vocabulary padding). `key`: the
    name whose stream it draws (a tied head, held apart by a pipeline's last stage, draws its embedding's)."""

    kind: str
    std: float = 0.0
    valid_rows: int | None = None
    key: str | None = None

    def __post_init__(self):
        assert self.kind in KINDS, self.kind


def block_rows(shape: Sequence[int]) -> int:
    """Rows of one drawn block of a tensor of `shape` (a 1-D tensor: elements)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _generator(seed: int, key: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw(init: Init, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One block of the full tensor in float32 on the CPU (the same numbers on every device)."""
    if init.kind == "zeros":
        return torch.zeros(shape)
    if init.kind == "ones":
        return torch.ones(shape)
    block = torch.empty(shape).normal_(0.0, init.std, generator=generator)
    if init.kind == "trunc_normal":  # on [-2 std, 2 std] by redrawing the 4.6% outside: exactly the truncated
        flat = block.view(-1)  # normal, several times faster than nn.init.trunc_normal_'s inverse CDF
        outside = (flat.abs() > 2 * init.std).nonzero().squeeze(1)
        while outside.numel():
            redrawn = torch.empty(outside.numel()).normal_(0.0, init.std, generator=generator)
            flat[outside] = redrawn
            outside = outside[redrawn.abs() > 2 * init.std]
    return block


@torch.no_grad()
def fill_(piece: torch.Tensor, init: Init, *, seed: int, key: str, full_shape: Sequence[int],
          offsets: Sequence[int]) -> None:
    """Write into `piece` its values as a part of the full tensor: piece = full[o0:o0+n0, o1:o1+n1, ...]
    for `offsets` o and piece's shape n, where full is the tensor `init` gives for (seed, key)."""
    full_shape, offsets = tuple(full_shape), tuple(offsets)
    assert len(full_shape) == piece.dim() == len(offsets), (full_shape, piece.shape, offsets)
    assert all(o + n <= f for o, n, f in zip(offsets, piece.shape, full_shape, strict=True)), (full_shape, piece.shape)
    if piece.numel() == 0:
        return
    key = init.key or key
    if piece.dim() == 0:
        piece.copy_(_draw(init, (), _generator(seed, key, 0)))
        return
    rows, first = full_shape[0], offsets[0]
    per_block = block_rows(full_shape)
    for block in range(first // per_block, (first + piece.shape[0] - 1) // per_block + 1):
        start, stop = block * per_block, min(rows, (block + 1) * per_block)
        real = stop if init.valid_rows is None else max(start, min(stop, init.valid_rows))
        values = _draw(init, (real - start, *full_shape[1:]), _generator(seed, key, block))  # the padding: zeros
        values = torch.cat([values, values.new_zeros(stop - real, *full_shape[1:])]) if real < stop else values
        lo, hi = max(start, first), min(stop, first + piece.shape[0])  # the piece's rows in this block
        values = values[lo - start:hi - start]
        for dim in range(1, piece.dim()):
            values = values.narrow(dim, offsets[dim], piece.shape[dim])  # plant: init_columns_from_zero
        piece[lo - first:hi - first].copy_(values)


def linear_rules(model: nn.Module, std: float, num_layers: int = 1, residual: Sequence[nn.Module] = (),
                 prefix: str = "") -> dict[str, Init]:
    """The rules of the usual transformer layers below `model` (names prefixed by `prefix`): truncated-normal
    linears with zero biases, unit norms, normal embeddings. The `residual` linears (a model's residual-stream
    projections, `ParallelPlan.residual_projections`) get std / sqrt(2 x num_layers) (GPT-2, Megatron)."""
    residual = {id(m) for m in residual}
    rules = {}
    for path, m in model.named_modules(prefix=prefix.rstrip(".")):
        name = f"{path}." if path else ""
        if isinstance(m, nn.Linear):
            scale = 1.0 / math.sqrt(2 * num_layers) if id(m) in residual else 1.0
            rules[f"{name}weight"] = Init("trunc_normal", std * scale)
            if m.bias is not None:
                rules[f"{name}bias"] = Init("zeros")
        elif isinstance(m, nn.LayerNorm | nn.RMSNorm):
            if m.weight is not None:
                rules[f"{name}weight"] = Init("ones")
            if getattr(m, "bias", None) is not None:
                rules[f"{name}bias"] = Init("zeros")
        elif isinstance(m, nn.Embedding):
            rules[f"{name}weight"] = Init("normal", std)
    return rules


def initialize(model: nn.Module, seed: int) -> None:
    """Fill every parameter of a whole (serial) `model` from its `init_rules()`: the full tensors the shards
    of every layout are cut from."""
    rules = model.init_rules()
    done = set()
    for name, param in model.state_dict(keep_vars=True).items():
        if isinstance(param, nn.Parameter) and id(param) not in done:
            done.add(id(param))
            fill_(param, rules[name], seed=seed, key=name, full_shape=param.shape, offsets=(0,) * param.dim())
