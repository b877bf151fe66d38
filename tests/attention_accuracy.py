"""The matrix's second observable: a case's context-parallel attention, as its build placed it, is as accurate
under the case's autocast as one process's SDPA is.

The loss curve cannot see every numerical defect: from random initialisation the scores are nearly uniform,
and the ring computing its softmax statistics in bf16 (issue 23, item 2) moves 4 steps of the tiny models by
no more than correct layouts already differ (docs/testing.md). Attention is where such a defect lives, so for
every case with cp > 1 under bf16 or fp16 the matrix also builds the case's model on the case's grid (the
real `build_model`: its tp head split, pipeline cut, cp variant and FSDP wrapping), takes the first
context-parallel attention core of this rank, and feeds it peaked queries (scores scaled by PEAK, where low
precision statistics hurt) of the case's sequence length. Its output and dQ, dK, dV on this rank's tokens are
compared with float64 SDPA over the whole sequence, and must be within SLACK x the relative error of serial
SDPA run under the same autocast on the same inputs (measured on its values at this rank's tokens).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BATCH = 2
PEAK = 6.0  # queries scaled up: peaked softmax rows, where the statistics' precision matters
SLACK = 1.25  # the ring's fp32 statistics measured at 0.9-1.1x SDPA's error (tests/test_cp_ring.py)


class AttentionLessAccurate(Exception):
    """A rank's attention as built is less accurate than serial SDPA: the check's own verdict, which the matrix tells
    by this name from any other error of a rank (an internal assert of the code under test is a crash)."""


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((g.detach().double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)]


def under_autocast(attend, q, k, v, grad, dtype: torch.dtype) -> list[torch.Tensor]:
    """[out, dQ, dK, dV] of `attend` run under autocast on inputs in the autocast dtype (as the blocks'
    linears hand them over)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    with torch.autocast(q.device.type, dtype=dtype):
        out = attend(*leaves)
    out.backward(grad.to(out.dtype))
    return [out] + [t.grad for t in leaves]


def check_rank(rank: int, world_size: int, cfg) -> None:
    """On one pooled rank of the case (torch.distributed already initialized; `cfg`: the case's typed config,
    `load_config` of its command line): raise when this rank's attention is less accurate than serial SDPA
    under the same autocast."""
    from distributed.context.attention import ContextParallelAttention
    from utils.comm import Axis, init_grid
    from utils.engine.build import build_model
    from utils.engine.precision import autocast_dtype
    from utils.tasks import build_task

    grid = init_grid(cfg.parallel)
    task = build_task(cfg)
    model = build_model(cfg, task, grid).raw
    core = next(m for m in model.modules() if isinstance(m, ContextParallelAttention))
    n, heads = task.tokens_per_sample(), cfg.model.num_heads // grid.size(Axis.TP)
    core.shards.enter(n, grid.device)
    gen = torch.Generator().manual_seed(1234 + grid.rank(Axis.TP))  # the same on every rank of a cp group
    q, k, v, grad = (torch.randn(BATCH, heads, n, cfg.model.embed_dim // cfg.model.num_heads, generator=gen,
                                 dtype=torch.float64) for _ in range(4))
    q = q * PEAK
    full = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=core.causal)
    out.backward(grad)
    shard = core.shards.shard
    want = [shard(t, 2) for t in (out.detach(), *(t.grad for t in full))]
    dtype = autocast_dtype(cfg.precision.mode)
    serial = under_autocast(lambda *t: F.scaled_dot_product_attention(*t, is_causal=core.causal), q, k, v, grad,
                            dtype)
    bound = relative_errors([shard(t, 2) for t in serial], want)
    got = relative_errors(under_autocast(core, *(shard(t, 2) for t in (q, k, v, grad)), dtype), want)
    if (report := os.environ.get("DLSCALE_MATRIX_REPORT")) and grid.rank(Axis.CP) == 0:  # docs/testing.md's ratios
        with open(report, "a") as out_file:
            ratios = " ".join(f"{g / b:.2f}" for g, b in zip(got, bound))
            out_file.write(f"attention rank {rank} {cfg.parallel.cp_attention} {cfg.precision.mode}: {ratios}\n")
    worse = [f"{name} {g:.2e} > {SLACK} x {b:.2e}" for name, g, b in zip(("out", "dQ", "dK", "dV"), got, bound)
             if g > SLACK * b]
    if worse:
        raise AttentionLessAccurate(f"rank {rank}: {cfg.parallel.cp_attention} attention under {cfg.precision.mode} "
                                    "autocast is less accurate than serial SDPA: " + ", ".join(worse))
