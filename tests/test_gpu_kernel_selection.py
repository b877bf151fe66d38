"""The ring blocks' kernel choice by compute capability, and the masked efficient path against the math path.

On the CPU the capability is stubbed and the efficient kernel is a stand-in that computes what the kernel is
documented to compute from an additive bias (scores + bias, softmax, log-sum-exp), independently of the math
path's boolean mask: `attend`/`attend_backward` with a block-structured mask (rows that see nothing included)
must give the math path's (out, lse) and (dQ, dK, dV). tests/test_gpu_blocks.py runs the real kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from distributed.context import blocks

V100, T4, A100, H100 = (7, 0), (7, 5), (8, 0), (9, 0)
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize("capability, dtype, masked, kind", [
    (None, F16, False, "math"), (V100, F16, False, "efficient"), (T4, F16, False, "efficient"),
    (T4, BF16, False, "math"), (V100, F32, False, "efficient"), (A100, BF16, False, "flash"),
    (H100, F16, False, "flash"), (H100, BF16, True, "efficient"), (V100, F16, True, "efficient"),
    (A100, F32, True, "efficient"), (H100, F64, True, "math"), ((3, 7), F32, False, "math")])
def test_kernel_by_capability(capability, dtype, masked, kind):
    assert blocks.select_kernel(capability, dtype, 64, masked) == kind


def test_capability_read_from_the_device(monkeypatch):
    """compute_capability (which `attend` asks for the tensors' device) is the driver's answer on CUDA only."""
    from distributed.device import compute_capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: V100)
    assert compute_capability(torch.device("cuda", 0)) == V100 and compute_capability("cpu") is None
    assert blocks.select_kernel(compute_capability("cuda:0"), F16, 64, False) == "efficient"  # Volta: no flash


def _bias_kernel(calls: list):
    """The efficient kernel's (forward, backward) as documented, on the CPU: additive bias, float32 sums."""
    def scores(q, k, bias, scale):
        assert bias is not None and bias.dtype == q.dtype and bias.stride(-2) % blocks.BIAS_ALIGN == 0
        assert bias.shape == (*q.shape[:-1], k.shape[-2]), "expanded over batch and heads, as SDPA passes it"
        return torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale + bias.float()

    def forward(q, k, v, causal, scale, bias=None):
        calls.append("forward")
        s = scores(q, k, bias, scale)
        lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees nothing (its output NaN, as a kernel may give)
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
        return out, torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32), value=float("nan"))

    def backward(dout, q, k, v, out, lse, causal, scale, bias=None):
        calls.append("backward")
        p = torch.exp(scores(q, k, bias, scale) - lse[..., :q.shape[-2], None])
        dout, v, k, q = dout.float(), v.float(), k.float(), q.float()
        ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out.float()).sum(-1, keepdim=True))
        return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, torch.matmul(
            p.transpose(-2, -1), dout)

    return forward, backward


@pytest.mark.parametrize("group", [1, 2])
def test_masked_block_on_the_efficient_path_equals_the_math_path(monkeypatch, group):
    torch.manual_seed(0)
    b, kv_heads, rows, nk, d, scale = 2, 2, 6, 5, 8, 0.3
    positions_q, positions_k = torch.tensor([0, 1, 2, 7, 8, 9]), torch.tensor([2, 3, 4, 5, 6])
    mask = (positions_q[:, None] >= positions_k[None, :]).repeat(group, 1)  # rows 0 and 1 see nothing
    q = torch.randn(b, kv_heads, group * rows, d, dtype=torch.float32)
    k, v = torch.randn(b, kv_heads, nk, d, dtype=torch.float32), torch.randn(b, kv_heads, nk, d, dtype=torch.float32)
    dout = torch.randn_like(q)
    want_out, want_lse = blocks.block_attention(q, k, v, mask, scale)
    calls = []
    monkeypatch.setattr(blocks, "compute_capability", lambda device: H100)
    monkeypatch.setattr(blocks, "select_kernel", lambda cap, dtype, dim, masked: "efficient" if masked else "math")
    monkeypatch.setitem(blocks._KERNELS, "efficient", _bias_kernel(calls))
    out, lse = blocks.attend(q, k, v, mask, False, scale, group)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    # the backward with the global output and lse (here: this block's own, the whole attention)
    delta = (dout * want_out).sum(-1, keepdim=True)
    want = blocks.block_backward(q, k, v, dout, delta, want_lse, mask, scale)
    got = blocks.attend_backward(q, k, v, dout, want_out, delta, want_lse, mask, False, scale, group)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, msg=name)
    assert calls == ["forward", "backward"]


def test_mask_bias_is_aligned_and_hides_what_the_mask_hides():
    mask = torch.tensor([[True, False, True], [False, False, False]]).repeat(3, 1)
    bias = blocks.mask_bias(mask, 2, torch.float16)
    assert bias.shape == (1, 1, 2, 3) and bias.stride(-2) == blocks.BIAS_ALIGN and bias.dtype == torch.float16
    assert torch.equal(bias[0, 0] == 0, mask[:2])
