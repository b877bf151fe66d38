"""What the planner prints: the table of layouts under its two header lines (the hardware, the workload), a
hint on each layout that does not fit, and the progress of a long --world search on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from utils.plan.options import Request
    from utils.plan.workload import Workload

PROGRESS_EVERY_S = 5.0  # seconds between two progress lines of a --world search (and one when it ends)


def collect(plans: Iterable, total: int, world: int) -> list:
    """The plans (utils.plan.cost_model.LayoutPlan) as they come, with a line on stderr every PROGRESS_EVERY_S
    seconds and one at the end: `planned 12/28 layouts of 64 ranks, 41 s`."""
    done, start = [], time.monotonic()
    last = start
    for plan in plans:
        done.append(plan)
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S or len(done) == total:
            print(f"planned {len(done)}/{total} layouts of {world} ranks, {now - start:.0f} s", file=sys.stderr,
                  flush=True)
            last = now
    return done


def fit_hint(plan, cfg) -> str:
    """For a layout that does not fit: the largest part of its memory and the settings that shrink it (a hint,
    not a plan: `python -m utils.plan` with them says whether they are enough)."""
    par = cfg.parallel
    state = plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes
    largest = max(state, plan.activation_bytes, plan.gathered_bytes)
    if largest == state:
        fsdp = "parallel.dp_mode=fsdp, " if par.dp_mode != "fsdp" and par.dp * par.cp > 1 else ""
        return f"weights+grads+Adam {state / 2**30:.1f} GiB: {fsdp}more tp/pp"
    if largest == plan.activation_bytes:
        ckpt = "" if cfg.trainer.activation_checkpointing else "trainer.activation_checkpointing=true, "
        return f"activations {largest / 2**30:.1f} GiB: {ckpt}trainer.grad_accum_steps, more tp/cp"
    reshard = "" if par.fsdp_reshard_after_forward else "parallel.fsdp_reshard_after_forward=true, "
    return f"FSDP gathered {largest / 2**30:.1f} GiB: {reshard}more tp/pp"


def table(plans: list, req: Request, workload: Workload | None = None) -> str:
    """Markdown table of LayoutPlans ranked by predicted step time (layouts that do not fit and refused ones last)."""
    hw = req.hardware
    lines = [f"planner: gpu={req.gpu}, peak {hw.peak} x efficiency {hw.efficiency}, links intra {hw.intra_gbs} / "
             f"inter {hw.inter_gbs} GB/s{f' (--bandwidths {req.links_from})' if req.links_from else ''}, "
             f"{hw.gpus_per_node} per node, {hw.memory_gb} GB; rank 0 (under pp the rank named); no overlap"]
    lines += [workload.line()] if workload is not None else []
    lines += ["| rank | layout | fits | step s | compute s | bubble s | comm s | params GiB | grads GiB | Adam GiB | "
              "activations GiB | FSDP gathered GiB | total GiB | host GiB | comm MB per step by axis | to fit |",
              "|" + "---|" * 16]
    for i, p in enumerate(plans, 1):
        if p.refused:
            lines.append(f"| - | {p.layout} | refused | {p.refused} |" + " |" * 12)
            continue
        gib = [f"{n / 2**30:.2f}" for n in (p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes,
                                            p.gathered_bytes, p.total_bytes, p.host_bytes)]
        # axes that round to 0.0 MB (a loss's few bytes) are left out: --json has every byte
        comm = ", ".join(f"{a} {n / 1e6:.1f}" for a, n in p.comm_bytes.items() if n >= 5e4) or "none"
        name = p.layout + (f" (rank {p.rank})" if p.rank else "")
        lines.append(f"| {i} | {name} | {'yes' if p.fits else 'NO'} | {p.step_time_s:.4g} | {p.compute_s:.4g} "
                     f"| {p.bubble_s:.4g} | {p.comm_s:.4g} | " + " | ".join(gib) + f" | {comm} | {p.to_fit} |")
    return "\n".join(lines)
