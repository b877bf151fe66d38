"""Transformer building blocks shared by the ViT and the language model.

Written serially with plain nn.Linear/nn.LayerNorm; `distributed.tensor.parallelize` swaps them for
parallel layers, following the roles a model declares (`networks/parallel_plan.py`; `BLOCK` there is
the plan of `Block`). What a declared attention module provides (`AttentionModule` there):
- `Attention.qkv` is one fused projection whose output features are ordered (head, {q,k,v}, head_dim),
  so a contiguous split of the output features gives each tensor-parallel rank whole heads.
- `Attention.attend` is the attention core on (B, heads, N, head_dim), a module of its own so that
  context parallelism swaps it for a distributed one (distributed/context/attention.py).
- `SequenceRegion` modules mark where activations enter and leave the sequence-sharded region, and
  (kind 'output') where per-token outputs are complete and a model needs every token again.
- `Attention.positions`: None, or (context parallelism) an object whose `local_positions` are the
  global positions of the tokens this rank holds; rotary embeddings read them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class SequenceRegion(nn.Identity):
    """Identity in a serial model; marks where the sequence is split ('enter'), gathered for the
    replicated layers after the blocks ('exit': sequence parallelism), or gathered after the per-token
    output layers ('output': context parallelism, whose layers after 'exit' still see a shard)."""

    def __init__(self, kind: str, seq_dim: int = 1, feeds_matmul: bool = False):
        super().__init__()
        assert kind in ("enter", "exit", "output")
        self.kind, self.seq_dim = kind, seq_dim
        self.feeds_matmul = feeds_matmul  # the next op is a matmul: a gather here may move its (autocast) dtype


class ScaledDotProductAttention(nn.Module):
    """Attention core on (B, heads, N, head_dim) q, k, v: torch's fused SDPA."""

    def __init__(self, causal: bool, dropout: float):
        super().__init__()
        self.causal, self.dropout = causal, dropout

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0, offset: int = 0):
    """cos/sin tables (N, head_dim/2) for rotary position embedding (RoFormer, Su et al. 2021)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    pos = torch.arange(offset, offset + seq_len, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of (B, h, N, d) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention with one fused QKV projection and an output projection."""

    def __init__(self, dim: int, num_heads: int, causal: bool = False, dropout: float = 0.0,
                 bias: bool = True, rotary_positions: int = 0):
        """`rotary_positions` > 0: rotary position embedding for up to that many positions (tables are
        computed once, as buffers that follow the module's device)."""
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads, self.head_dim = num_heads, dim // num_heads  # num_heads: of the serial module
        self.rotary = rotary_positions > 0
        if self.rotary:
            cos, sin = rotary_tables(rotary_positions, self.head_dim)
            self.register_buffer("rotary_cos", cos, persistent=False)  # (max_positions, head_dim/2)
            self.register_buffer("rotary_sin", sin, persistent=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.attend = ScaledDotProductAttention(causal, dropout)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.positions = None  # context parallelism: the token layout (see the module docstring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, N, heads_local * 3 * head_dim)
        qkv = qkv.unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)  # (3, B, h, N, hd)
        q, k, v = qkv.unbind(0)
        if self.rotary:
            index = slice(0, q.shape[-2]) if self.positions is None else self.positions.local_positions
            cos, sin = self.rotary_cos[index], self.rotary_sin[index]  # (N, head_dim/2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.attend(q, k, v)  # (B, h, N, hd)
        return self.proj(y.transpose(1, 2).flatten(2))  # (B, N, C)


class MLP(nn.Module):
    """Two-layer GELU MLP, hidden = ratio * dim."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, causal: bool = False,
                 dropout: float = 0.0, bias: bool = True, rotary_positions: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, causal, dropout, bias, rotary_positions)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout, bias)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


def init_weights(module: nn.Module, std: float = 0.02, num_layers: int = 1, residual: Iterable[nn.Module] = ()) -> None:
    """Truncated-normal linears, unit norms. The `residual` linears (a model's declared residual-stream
    projections, `ParallelPlan.residual_projections`) get their std scaled by 1/sqrt(2 x num_layers) (GPT-2)."""
    residual = set(residual)
    for m in module.modules():
        if isinstance(m, nn.Linear):
            scale = 1.0 / math.sqrt(2 * num_layers) if m in residual else 1.0
            nn.init.trunc_normal_(m.weight, std=std * scale, a=-2 * std, b=2 * std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
