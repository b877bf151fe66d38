"""One block of the ring: the attention of some query rows to one K/V block, forward and backward.

Three ways to compute a block, picked by `select_kernel` from the device's compute capability, the dtype, the
head dim and whether the block has an arbitrary mask:
- `math` (every device, every dtype; the CPU path): `block_attention` and `block_backward` below, explicit
  scores in the compute dtype (float32 for half precisions), any boolean mask.
- `flash` (CUDA sm80+, fp16/bf16, head dim a multiple of 8 up to 256, no mask or the square causal one):
  `torch.ops.aten._scaled_dot_product_flash_attention` and its backward op, which return and take the
  log-sum-exp (Dao 2023). Volta (sm70) and Turing (sm75) have no flash kernel in torch.
- `efficient` (CUDA sm50+, fp16/fp32, bf16 from sm80, head dim a multiple of 8):
  `_scaled_dot_product_efficient_attention` with `compute_log_sumexp=True` and its backward op (xformers'
  memory-efficient kernel, Rabe & Staats 2021). It also takes an additive bias, so a block with an arbitrary
  position mask (the generic masked path: uneven causal layouts, the hierarchical ring, block-structured
  masks) runs it with the mask as a 0/-inf bias (`mask_bias`); a query row the mask hides entirely gets the
  math path's answer (out 0, lse -inf), whatever the kernel left there.

The kernels' conventions are adapted in one place (`lse_from_kernel`, `lse_to_kernel`): their log-sum-exp
is float32, natural log, (B, h, rows), the efficient kernel's rows padded to a multiple of 32; the ring's is
(B, h, rows) in the compute dtype. The kernels take one query head per key/value head, so a grouped
block's folded query rows (B, G, r x rows, d) are unfolded to (B, G x r, rows, d) around the call, K/V
repeated r times for it (a transient copy of one block; what travels stays grouped) and dK/dV summed back
over each group. The kernels compute each block in the input dtype with float32 accumulation and return
its output in the input dtype; the merge across blocks stays float32. The backward kernels recompute the
block's probabilities from the global output and log-sum-exp, as `block_backward` does (flash-attention's
backward, alg. 2): their sums over blocks are the exact gradients.

Only the two kernel calls (`_KERNELS`) need a GPU: tests/test_cp_ring.py and tests/test_gpu_kernel_selection.py
check `select_kernel` with stubbed capabilities and run every other line of the kernel path (the masked one
included) with CPU stand-ins that return each kernel's results in its layout; tests/test_gpu_blocks.py (`-m gpu`)
compares the real kernels with the math path on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distributed.device import compute_capability

LSE_ROWS_ALIGN = {"flash": 1, "efficient": 32}  # the efficient kernel pads its lse's query rows to a multiple of 32
HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the sums: float32 for half precisions, the input's own otherwise."""
    return torch.float32 if dtype in HALF else dtype


FLASH_MIN_CAPABILITY = (8, 0)  # torch's flash-attention 2 kernels: Ampere and newer
BF16_MIN_CAPABILITY = (8, 0)  # bf16 tensor cores: Ampere and newer
EFFICIENT_MIN_CAPABILITY = (5, 0)  # the memory-efficient kernel: Maxwell and newer
BIAS_ALIGN = 16  # the efficient kernel reads a bias whose rows start at multiples of 16 elements


def select_kernel(capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """`flash`, `efficient` or `math` for a block on a device of compute `capability` (None: not CUDA):
    flash for fp16/bf16 from sm80 with a head dim that is a multiple of 8 up to 256 and no arbitrary mask
    (`masked`); the efficient kernel for fp16/fp32 (bf16 from sm80), head dim a multiple of 8, with or without
    a mask; the math path otherwise (the CPU, float64, other head dims, bf16 before sm80, very old GPUs)."""
    if capability is None or tuple(capability) < EFFICIENT_MIN_CAPABILITY or head_dim % 8:
        return "math"
    if dtype == torch.bfloat16 and tuple(capability) < BF16_MIN_CAPABILITY:
        return "math"
    if dtype in HALF and head_dim <= 256 and not masked and tuple(capability) >= FLASH_MIN_CAPABILITY:
        return "flash"
    return "efficient" if dtype in (*HALF, torch.float32) else "math"


def mask_bias(mask: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `rows` rows of a boolean mask (nq, nk) as the efficient kernel's additive bias: 0 where a key
    is visible, -inf where not, in `dtype`, its rows aligned to BIAS_ALIGN elements in memory (a view of a
    padded tensor, as torch's own SDPA pads it), broadcast over batch and heads (1, 1, rows, nk)."""
    nk = mask.shape[-1]
    bias = torch.zeros(rows, nk + (-nk % BIAS_ALIGN), dtype=dtype, device=mask.device)
    bias[:, :nk].masked_fill_(~mask[:rows], float("-inf"))
    return bias[:, :nk][None, None]


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


def _flash_forward(q, k, v, causal: bool, scale: float, bias=None):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, causal: bool, scale: float, bias=None):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse


def _efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
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


def _kernel_mask(mask: torch.Tensor | None, causal: bool, q: torch.Tensor, nk: int) -> dict:
    """The kernel's `bias` keyword for an arbitrary mask (none for no mask or the square causal one), expanded to
    the unfolded queries q (B, H, rows, d) as torch's SDPA expands it (strides 0 over batch and heads)."""
    if mask is None or causal:
        return {}
    return {"bias": mask_bias(mask, q.shape[-2], q.dtype).expand(q.shape[0], q.shape[1], q.shape[-2], nk)}


def _kind(q: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> str:
    """The kernel of a block; a mask per batch row (packed documents, (B, 1, rows, keys)) takes the math path."""
    if mask is not None and mask.dim() > 2:
        return "math"
    return select_kernel(compute_capability(q.device), q.dtype, q.shape[-1], mask is not None and not causal)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of folded query rows q (B, G, group x rows, d) against one K/V block (B, G, nk, d), in the
    compute dtype. `causal`: `mask` is the square causal one (the kernels take it as `is_causal`); another
    mask goes to the efficient kernel as a bias, or to the math path."""
    kind = _kind(q, mask, causal)
    if kind == "math":
        return block_attention(q, k, v, mask, scale)
    rows, dtype, heads = q.shape[-2] // group, compute_dtype(q.dtype), _heads(q, group)
    out, lse = _KERNELS[kind][0](heads, _repeat(k, group), _repeat(v, group), causal, scale,
                                 **_kernel_mask(mask, causal, heads, k.shape[-2]))
    lse = lse_from_kernel(lse, kind, rows, dtype)
    if mask is not None and not causal:  # rows that see no key: out 0 and lse -inf, as block_attention gives
        seen = mask[:rows].any(dim=-1)  # (rows,)
        out, lse = out.masked_fill(~seen[:, None], 0.0), lse.masked_fill(~seen, float("-inf"))
    return _fold(out, group).to(dtype), _fold(lse, group)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                    delta: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
                    group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block in the compute dtype: q, dout, out (the global output's rows) in the input
    dtype, delta = rowsum(dO * O) and lse (the global log-sum-exp's rows) in the compute dtype."""
    kind = _kind(q, mask, causal)
    dtype = compute_dtype(q.dtype)
    if kind == "math":
        return block_backward(q.to(dtype), k, v, dout.to(dtype), delta, lse, mask, scale)
    lse = lse.masked_fill(~torch.isfinite(lse), 0.0)  # a row that saw no key: p = exp(-inf) = 0, as block_backward
    heads = _heads(q, group)
    dq, dk, dv = _KERNELS[kind][1](_heads(dout, group), heads, _repeat(k, group), _repeat(v, group),
                                   _heads(out, group), lse_to_kernel(_heads(lse, group), kind), causal, scale,
                                   **_kernel_mask(mask, causal, heads, k.shape[-2]))
    total = lambda t: t.unflatten(1, (-1, group)).sum(2).to(dtype)  # noqa: E731  each group's heads summed
    return _fold(dq, group).to(dtype), total(dk), total(dv)
