"""One block of the ring: the attention of some query rows to one K/V block, forward and backward.

Three ways to compute a block, picked by `select_kernel` from the device, dtype and head dim alone:
- `math` (every device, every dtype; the CPU path): `block_attention` and `block_backward` below, explicit
  scores in the compute dtype (float32 for half precisions), any boolean mask.
- `flash` (CUDA, fp16/bf16, head dim a multiple of 8 up to 256, no mask or the square causal one):
  `torch.ops.aten._scaled_dot_product_flash_attention` and its backward op, which return and take the
  log-sum-exp (Dao 2023).
- `efficient` (CUDA, fp16/bf16/fp32, head dim a multiple of 8, no mask or the square causal one):
  `_scaled_dot_product_efficient_attention` with `compute_log_sumexp=True` and its backward op (xformers'
  memory-efficient kernel, Rabe & Staats 2021).
A block with an arbitrary position mask (the generic masked path: uneven causal layouts, the hierarchical
ring) runs the math path on every device.

The kernels' conventions are adapted in one place (`lse_from_kernel`, `lse_to_kernel`): their log-sum-exp
is float32, natural log, (B, h, rows), the efficient kernel's rows padded to a multiple of 32; the ring's is
(B, h, rows) in the compute dtype. The kernels take one query head per key/value head, so a grouped
block's folded query rows (B, G, r x rows, d) are unfolded to (B, G x r, rows, d) around the call, K/V
repeated r times for it (a transient copy of one block; what travels stays grouped) and dK/dV summed back
over each group. The kernels compute each block in the input dtype with float32 accumulation and return
its output in the input dtype; the merge across blocks stays float32. The backward kernels recompute the
block's probabilities from the global output and log-sum-exp, as `block_backward` does (flash-attention's
backward, alg. 2): their sums over blocks are the exact gradients.

Only the two kernel calls (`_KERNELS`) need a GPU: tests/test_cp_ring.py checks `select_kernel` on CPU
cases and runs the ring through every other line of the kernel path with CPU stand-ins that return the
math path's results in each kernel's layout. Not yet run on a GPU (the project's machine has none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LSE_ROWS_ALIGN = {"flash": 1, "efficient": 32}  # the efficient kernel pads its lse's query rows to a multiple of 32
HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the sums: float32 for half precisions, the input's own otherwise."""
    return torch.float32 if dtype in HALF else dtype


def select_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """`flash`, `efficient` or `math` for a block: CUDA only; no arbitrary mask (`masked`); flash for fp16/bf16
    with a head dim that is a multiple of 8 up to 256, the efficient kernel for fp32 too (head dim a
    multiple of 8); the math path otherwise (float64, other head dims, masks, CPU)."""
    if torch.device(device).type != "cuda" or masked or head_dim % 8:
        return "math"
    if dtype in HALF and head_dim <= 256:
        return "flash"
    return "efficient" if dtype in (*HALF, torch.float32) else "math"


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled scores S * scale (B, h, nq, nk), -inf where `mask` is False."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The math path: exact attention of q (B, h, nq, d) to one key block k, v (B, h, nk, d): (out, lse).

    `mask`: bool (nq, nk), True = may attend, or None (all visible). Returns out (B, h, nq, d) and the
    log-sum-exp of the scaled scores lse (B, h, nq), both in `compute_dtype` of the input. A fully
    masked row gives lse = -inf and out = 0 (no NaN).
    """
    dtype = compute_dtype(q.dtype)
    s = _scores(q.to(dtype), k.to(dtype), mask, scale)
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v.to(dtype)) / torch.where(total > 0, total, torch.ones_like(total))
    lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf for fully masked rows
    return out, lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                   lse: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The math path's (dQ, dK, dV) contributions of one key block, from probabilities recomputed with the
    saved lse; q, dout, delta = rowsum(dO * O) (B, h, nq, 1) and lse in the compute dtype."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    p = torch.exp(_scores(q, k, mask, scale) - finite)
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def lse_from_kernel(lse: torch.Tensor, kind: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's log-sum-exp (natural log, its query rows padded) as the ring's: (B, h, rows) in `dtype` (the
    compute dtype: float32, the kernels' own, for every dtype a kernel takes)."""
    return lse[..., :rows].to(dtype)


def lse_to_kernel(lse: torch.Tensor, kind: str) -> torch.Tensor:
    """The ring's log-sum-exp (B, h, rows) in the layout a kernel's backward reads (its query rows padded)."""
    return F.pad(lse, (0, -lse.shape[-1] % LSE_ROWS_ALIGN[kind])).contiguous()


def _flash_forward(q, k, v, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, causal: bool, scale: float):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse


def _efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


_KERNELS = {"flash": (_flash_forward, _flash_backward), "efficient": (_efficient_forward, _efficient_backward)}


def _heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Folded query rows (B, G, group x rows, ...) as one head per query head (B, G x group, rows, ...)."""
    return x.unflatten(2, (group, -1)).flatten(1, 2).contiguous()


def _fold(x: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of `_heads`."""
    return x.unflatten(1, (-1, group)).flatten(2, 3)


def _repeat(x: torch.Tensor, group: int) -> torch.Tensor:
    return (x if group == 1 else x.repeat_interleave(group, dim=1)).contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of folded query rows q (B, G, group x rows, d) against one K/V block (B, G, nk, d), in the
    compute dtype. `causal`: `mask` is the square causal one (the kernels take it as `is_causal`)."""
    kind = select_kernel(q.device, q.dtype, q.shape[-1], mask is not None and not causal)
    if kind == "math":
        return block_attention(q, k, v, mask, scale)
    out, lse = _KERNELS[kind][0](_heads(q, group), _repeat(k, group), _repeat(v, group), causal, scale)
    dtype = compute_dtype(q.dtype)
    return _fold(out, group).to(dtype), _fold(lse_from_kernel(lse, kind, q.shape[-2] // group, dtype), group)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                    delta: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
                    group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block in the compute dtype: q, dout, out (the global output's rows) in the input
    dtype, delta = rowsum(dO * O) and lse (the global log-sum-exp's rows) in the compute dtype."""
    kind = select_kernel(q.device, q.dtype, q.shape[-1], mask is not None and not causal)
    dtype = compute_dtype(q.dtype)
    if kind == "math":
        return block_backward(q.to(dtype), k, v, dout.to(dtype), delta, lse, mask, scale)
    dq, dk, dv = _KERNELS[kind][1](_heads(dout, group), _heads(q, group), _repeat(k, group), _repeat(v, group),
                                   _heads(out, group), lse_to_kernel(_heads(lse, group), kind), causal, scale)
    total = lambda t: t.unflatten(1, (-1, group)).sum(2).to(dtype)  # noqa: E731  each group's heads summed
    return _fold(dq, group).to(dtype), total(dk), total(dv)
