"""`-m gpu`: the ring's flash and efficient kernels against the math path, on the GPU (skipped without CUDA).

Each kernel the device's compute capability offers (distributed/context/blocks.py `select_kernel`), in every
dtype it takes, for a block with no mask, the square causal mask and a block-structured position mask (rows
that see no key included, the efficient kernel's bias): `attend` and `attend_backward` against the math path's
(out, lse) and (dQ, dK, dV) computed in float64 from the same inputs, with folded grouped heads.
"""

from __future__ import annotations

import pytest
import torch

from distributed.context import blocks
from distributed.device import compute_capability

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}  # relative to the largest reference value


def _inputs(dtype, group: int, rows: int, nk: int, d: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + nk)
    q = torch.randn(2, 2, group * rows, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, nk, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(q.shape, device="cuda", generator=gen).to(dtype)


def _masks(rows: int, nk: int, group: int) -> dict:
    causal = torch.ones(rows, nk, dtype=torch.bool, device="cuda").tril().repeat(group, 1)
    q_pos, k_pos = torch.arange(rows, device="cuda") + nk // 2, torch.arange(nk, device="cuda") + rows // 2
    return {"none": (None, False), "causal": (causal, True),
            "positions": ((q_pos[:, None] >= k_pos[None, :]).repeat(group, 1), False)}


def _close(got, want, dtype, what):
    """The largest error relative to the largest reference value, over the entries whose float64 reference is
    finite; a NaN or inf the kernel returns where the reference is finite fails (tests/test_gpu_logic.py)."""
    finite = torch.isfinite(want)
    wrong = int((finite & ~torch.isfinite(got)).sum())
    assert wrong == 0, f"{what}: {wrong} NaN or inf values where the reference is finite"
    scale = want[finite].abs().max().clamp_min(1e-6)
    err = ((got.double() - want)[finite].abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2g} > {TOL[dtype]:.2g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "positions"])
@pytest.mark.parametrize("group", [1, 2])
def test_kernels_match_the_math_path(dtype, mask_kind, group):
    rows = nk = 96 if mask_kind == "causal" else 80
    mask, causal = _masks(rows, nk, group)[mask_kind]
    kind = blocks.select_kernel(compute_capability("cuda"), dtype, 64, mask is not None and not causal)
    if kind == "math":
        pytest.skip(f"this GPU runs {dtype} {mask_kind} blocks on the math path")
    q, k, v, dout = _inputs(dtype, group, rows, nk)
    scale = 64 ** -0.5
    want_out, want_lse = blocks.block_attention(q.double(), k.double(), v.double(), mask, scale)
    out, lse = blocks.attend(q, k, v, mask, causal, scale, group)
    _close(out, want_out, dtype, f"{kind} out")
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{kind}: rows that see no key"
    _close(lse[seen], want_lse[seen], dtype, f"{kind} lse")
    delta = (dout.double() * want_out).sum(-1, keepdim=True)
    want = blocks.block_backward(q.double(), k.double(), v.double(), dout.double(), delta, want_lse, mask, scale)
    got = blocks.attend_backward(q, k, v, dout, want_out.to(dtype), delta.to(lse.dtype), want_lse.to(lse.dtype),
                                 mask, causal, scale, group)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(g, w, dtype, f"{kind} {name}")
