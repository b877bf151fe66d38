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

Generation (utils/language/task/sampling.py) passes a `DecodeStep` to the forward: each row's token positions, which
keys each new token may attend (padding and the future masked) and the layer's `KVCache`. Training never
does, and its path is the one without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from networks.documents import Documents


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

    def forward(self, q, k, v, documents: Documents | None = None):
        """k and v may hold fewer heads than q (grouped-query attention: query head i reads kv head i // r).
        `documents` (packed rows with `data.attention=document`): attention inside each document only."""
        p = self.dropout if self.training else 0.0
        if documents is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask(), dropout_p=p,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal,
                                              enable_gqa=k.shape[1] != q.shape[1])


@dataclass(frozen=True)
class Rotary:
    """Rotary position embedding (RoFormer, Su et al. 2021) for up to `positions` positions.

    Frequencies base^(-2i/head_dim), i < head_dim/2. `scaling` (Llama 3.1's long-context rule): (factor,
    low_freq_factor, high_freq_factor, original_positions); wavelengths longer than original/low are divided
    by `factor`, shorter than original/high kept, the band between interpolated smoothly.
    """

    positions: int
    base: float = 10000.0
    scaling: tuple[float, float, float, int] | None = None

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Angular frequency per rotated pair (head_dim/2,), float32."""
        inv_freq = 1.0 / self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        if self.scaling is None:
            return inv_freq
        factor, low, high, original = self.scaling
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)  # 0 at wavelength original/low, 1 at original/high
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        between = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)

    def tables(self, head_dim: int, seq_len: int | None = None, offset: int = 0,
               device: torch.device | None = None):
        """cos/sin tables (N, head_dim/2) of positions offset .. offset+N-1 (N = `positions` by default)."""
        seq_len = self.positions if seq_len is None else seq_len
        pos = torch.arange(offset, offset + seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(pos, self.inv_freq(head_dim).to(pos.device))
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of (B, h, N, d) by position-dependent angles (the
    'rotate half' pairing of GPT-NeoX and of Hugging Face's Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class KVCache:
    """Keys and values (B, kv_heads, T, head_dim) of the tokens one attention layer has seen, grown by each step."""

    def __init__(self):
        self.k = self.v = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values followed by `k`, `v` (the new tokens'), kept for the next step."""
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


@dataclass
class DecodeStep:
    """What one generation forward gives a layer besides its input (N new tokens, T keys in all)."""

    positions: torch.Tensor  # (B, N) int64: each new token's position in its own text (padding not counted)
    mask: torch.Tensor  # (B, 1, N, T) bool: the keys each new token attends (earlier real tokens and itself)
    cache: KVCache | None = None  # this layer's keys and values of the earlier tokens (None: N = T, no cache)


class Attention(nn.Module):
    """Multi-head self-attention with one fused QKV projection and an output projection; grouped-query
    attention (GQA, Ainslie et al. 2023) when `num_kv_heads` < `num_heads`.

    The fused projection's output features are ordered (kv group, [the group's q heads, k, v], head_dim):
    group g holds query heads g*r .. g*r+r-1 (r = num_heads / num_kv_heads) and key/value head g, so a
    contiguous split over tensor-parallel ranks gives each rank whole groups. With num_kv_heads = num_heads
    that is (head, {q, k, v}, head_dim). `q_per_group` is the query heads of each group this module
    computes: r, or fewer when tensor parallelism splits a group's queries over ranks that each keep its
    key/value head (distributed/tensor/parallelize.py).
    """

    def __init__(self, dim: int, num_heads: int, causal: bool = False, dropout: float = 0.0,
                 bias: bool = True, rotary: Rotary | None = None, num_kv_heads: int | None = None):
        """`rotary`: rotary position embedding (tables computed once, as buffers that follow the module's
        device); None for none."""
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        assert dim % num_heads == 0 and num_heads % num_kv_heads == 0
        self.num_heads, self.head_dim = num_heads, dim // num_heads  # of the serial module
        self.num_kv_heads = num_kv_heads
        self.q_per_group = num_heads // num_kv_heads
        self.rotary = rotary is not None
        self.rotary_spec = rotary
        if self.rotary:
            self.register_buffer("rotary_cos", None, persistent=False)  # (max_positions, head_dim/2)
            self.register_buffer("rotary_sin", None, persistent=False)
            self.init_buffers()
        self.qkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)
        self.attend = ScaledDotProductAttention(causal, dropout)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.positions = None  # context parallelism: the token layout (see the module docstring)

    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the rotary tables on `device` (default: the default device; the build calls it again
        on the rank's device once a meta-built model is allocated, utils/engine/materialize.py)."""
        if self.rotary:
            self.rotary_cos, self.rotary_sin = self.rotary_spec.tables(self.head_dim, device=device)

    def forward(self, x: torch.Tensor, step: DecodeStep | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """`documents`: packed rows (networks/documents.py): rotary at positions reset per document, and the core
        given them when attention stays inside each document."""
        r = self.q_per_group
        qkv = self.qkv(x).unflatten(-1, (-1, r + 2, self.head_dim))  # (B, N, groups_local, r + 2, hd)
        q = qkv[..., :r, :].flatten(2, 3).transpose(1, 2)  # (B, groups_local * r, N, hd)
        k, v = (qkv[..., i, :].transpose(1, 2) for i in (r, r + 1))  # (B, groups_local, N, hd)
        if step is not None:
            return self.proj(self._decode(q, k, v, step).transpose(1, 2).flatten(2))  # (B, N, C)
        if self.rotary:
            index = slice(0, q.shape[-2]) if self.positions is None else self.positions.local_positions
            if documents is not None:  # each token's position in its document: (B, 1, N, head_dim/2) tables
                index = documents.positions[:, index][:, None]
            cos, sin = self.rotary_cos[index], self.rotary_sin[index]  # (N, head_dim/2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        masked = documents is not None and documents.masked  # the core needs them only to mask
        y = self.attend(q, k, v, documents) if masked else self.attend(q, k, v)  # (B, h, N, hd)
        return self.proj(y.transpose(1, 2).flatten(2))  # (B, N, C)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """Generation's attention core: rotary at each row's own positions, the cache's keys before the new ones,
        the step's mask in place of the causal flag (the same softmax attention as `attend`, in one process)."""
        if self.rotary:
            cos, sin = (table[step.positions][:, None] for table in (self.rotary_cos, self.rotary_sin))  # (B,1,N,d/2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if step.cache is not None:
            k, v = step.cache.extend(k, v)  # (B, groups, T, hd)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, enable_gqa=k.shape[1] != q.shape[1])


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


class SwiGLU(nn.Module):
    """Gated MLP (Shazeer 2020; Llama): fc2(silu(gate(x)) * up(x)), hidden units `hidden`.

    `fc1` is the gate and up projections fused, their output features interleaved (hidden unit, {gate, up}):
    a contiguous split over tensor-parallel ranks (tp dividing `hidden`) gives each rank matching gate and up
    rows, so it has the same column/row pair, names and communication as `MLP`.
    """

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.fc1 = nn.Linear(dim, 2 * hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        gate, up = self.fc1(x).unflatten(-1, (-1, 2)).unbind(-1)  # (B, N, hidden_local) each
        return self.drop(self.fc2(F.silu(gate) * up))


NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")


def make_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm (with bias) or RMSNorm (Zhang and Sennrich 2019; Llama), weight only."""
    return nn.LayerNorm(dim, eps=eps) if kind == "layernorm" else nn.RMSNorm(dim, eps=eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    GPT-2 and the ViT: LayerNorm, GELU MLP with biases; Llama: RMSNorm, SwiGLU, no biases, grouped K/V.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, causal: bool = False,
                 dropout: float = 0.0, bias: bool = True, rotary: Rotary | None = None, *,
                 num_kv_heads: int | None = None, norm: str = "layernorm", mlp: str = "gelu",
                 mlp_hidden: int | None = None, norm_eps: float = 1e-5):
        super().__init__()
        hidden = mlp_hidden or int(dim * mlp_ratio)
        self.norm1 = make_norm(norm, dim, norm_eps)
        self.attn = Attention(dim, num_heads, causal, dropout, bias, rotary, num_kv_heads)
        self.drop = nn.Dropout(dropout)
        self.norm2 = make_norm(norm, dim, norm_eps)
        self.mlp = MLP(dim, hidden, dropout, bias) if mlp == "gelu" else SwiGLU(dim, hidden, dropout, bias)

    def forward(self, x, step: DecodeStep | None = None, documents: Documents | None = None):
        """`step`: generation only (an attention module of another class needs only `attn(x)`); `documents`:
        packed rows (networks/documents.py)."""
        h = self.norm1(x)
        if documents is not None:
            x = x + self.drop(self.attn(h, documents=documents))
        else:
            x = x + self.drop(self.attn(h) if step is None else self.attn(h, step))
        return x + self.mlp(self.norm2(x))
