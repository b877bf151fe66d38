"""Collective bus bandwidth on every axis group of the intended layout, against the planner's assumed links.

For each axis of the grid above one rank (tp, cp, dp, pp, each rank in its own group of that axis, every group
at once, as training runs them) and each message size, the counted collectives of distributed/collectives.py
run `iters` timed times after `warmup` untimed ones; the first untimed call also checks the values they deliver.
The time of an axis is the slowest rank's (a max over the world), so a slow group is not hidden by a fast one.

Definitions are nccl-tests' (its doc/PERFORMANCE.md): S is the message size, algbw = S / t, and the bus bandwidth
busbw = algbw x factor is what each link carries, comparable across ops and rank counts: all-reduce
2(n-1)/n with S the buffer, all-gather (n-1)/n with S the gathered buffer, reduce-scatter (n-1)/n with S the
full input, all-to-all (n-1)/n with S the buffer each rank sends, send/recv (each rank to the next of the ring,
distributed.collectives.ring_shift) 1. The planner (utils/plan/cost_model.py) divides the bytes one rank sends
by its link bandwidth, which is busbw; `bandwidth_file` writes the figures it reads (`--bandwidths FILE`).
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from distributed.collectives import all_gather, all_reduce, all_reduce_, all_to_all, barrier, reduce_scatter, ring_shift
from distributed.device import synchronize
from utils.comm import Axis, AxisGroup, Grid
from utils.doctor.report import Check
from utils.engine.flops import device_name
from utils.plan.options import GPUS, Hardware

# The fraction of a nominal link that nccl-tests' bus bandwidth reaches on a healthy node, by link type: NVLink
# about 80% (H100 SXM: 450 GB/s per direction nominal, all_reduce_perf / all_gather_perf reach about 360-380
# GB/s at 256 MiB-8 GiB on DGX H100; A100 NVLink3: about 230-240 of 300), InfiniBand/RoCE about 90% (NDR
# 400 Gb/s = 50 GB/s per GPU nominal, 45-48 GB/s measured across nodes). Sources: NVIDIA's DGX H100 and
# DGX A100 user guides (nccl-tests figures) and the nccl-tests issue tracker; an axis passes at this fraction of
# the planner's assumed link, warns between it and --min-bandwidth-fraction, fails below that.
ACHIEVABLE_FRACTION = {"inside a node": 0.80, "across nodes": 0.90}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
PLANNER_OPS = ("all_gather", "reduce_scatter")  # intra_gbs / inter_gbs: the sequence-parallel and FSDP collectives
GB = 1e9


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(op, (n - 1) / n)


def _run(op: str, x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """One `op` on `x` (the message: the buffer, the gathered output's shard or the full input) over `axis`."""
    n = axis.size
    if op == "all_reduce":
        return all_reduce_(x, axis)
    if op == "all_gather":
        return all_gather(x, axis, 0, [x.shape[0]] * n)
    if op == "reduce_scatter":
        return reduce_scatter(x, axis, 0)
    if op == "all_to_all":
        k = x.shape[0] // n
        return all_to_all(x, axis, 0, 0, [k] * n, [k] * n)
    return ring_shift([x], axis, [x.shape])()[0]


def _message(op: str, numel: int, axis: AxisGroup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank passes to `op` for a message of `numel` fp32 elements, what it must get back): small
    integers, exact in fp32, that differ by rank and by chunk."""
    n, r = axis.size, axis.rank
    k = numel // n
    chunk = torch.arange(n, device=device, dtype=torch.float32).repeat_interleave(k)  # chunk j holds j
    if op == "all_reduce":
        return torch.full((k * n,), r + 1.0, device=device), torch.full((k * n,), n * (n + 1) / 2, device=device)
    if op == "all_gather":
        return torch.full((k,), r + 1.0, device=device), chunk + 1
    if op == "reduce_scatter":
        return chunk + r, torch.full((k,), n * r + n * (n - 1) / 2, device=device)
    if op == "all_to_all":
        return chunk + n * r, chunk * n + r
    return torch.full((k * n,), float(r), device=device), torch.full((k * n,), float((r - 1) % n), device=device)


def time_op(op: str, numel: int, axis: AxisGroup, grid: Grid, warmup: int, iters: int) -> tuple[float, bool]:
    """(seconds per call on the slowest rank of the world, whether every rank got the right values)."""
    x, want = _message(op, numel, axis, grid.device)
    ok = torch.equal(_run(op, x.clone(), axis), want)
    for _ in range(warmup - 1):
        _run(op, x, axis)
    synchronize(grid.device)
    barrier(axis)
    start = time.perf_counter()
    for _ in range(iters):
        _run(op, x, axis)
    synchronize(grid.device)
    seconds = time.perf_counter() - start
    worst = all_reduce(torch.tensor([seconds / iters, float(not ok)], device=grid.device), grid.world, "max")
    return float(worst[0]), float(worst[1]) == 0.0


def spans_nodes(grid: Grid, axis: Axis, node_of: list[int]) -> bool:
    """Whether some group of `axis` holds ranks of more than one node."""
    return any(len({node_of[r] for r in ranks}) > 1 for ranks in grid.layout[axis])


def measure(grid: Grid, sizes_mib: list[float], warmup: int, iters: int, node_of: list[int]) -> dict:
    """{axis: {'size', 'spans_nodes', 'sizes': {bytes: {op: {'algbw_gbs', 'busbw_gbs', 'ok'}}}}} for every axis
    above one rank; every rank calls it (each times its own group; the figures are the world's slowest)."""
    groups = {}
    for axis in grid.order:
        group = grid.axis(axis)
        if group.size == 1:
            continue
        per_size = {}
        for mib in sizes_mib:
            numel = max(group.size, int(mib * 2**20 / 4) // group.size * group.size)  # fp32, a multiple of n
            row = {}
            for op in OPS:
                seconds, ok = time_op(op, numel, group, grid, warmup, iters)
                algbw = numel * 4 / seconds / GB
                row[op] = {"algbw_gbs": algbw, "busbw_gbs": algbw * bus_factor(op, group.size), "ok": ok}
            per_size[numel * 4] = row
        groups[axis.value] = {"size": group.size, "spans_nodes": spans_nodes(grid, axis, node_of), "sizes": per_size}
    grid.reset_comm_bytes()
    return groups


def largest(group: dict) -> dict[str, float]:
    """busbw in GB/s of each op at the group's largest message."""
    return {op: fig["busbw_gbs"] for op, fig in group["sizes"][max(group["sizes"])].items()}


def link_gbs(groups: dict, across_nodes: bool) -> float | None:
    """Median of the largest messages' all-gather and reduce-scatter busbw over the groups inside one node
    (`across_nodes` False) or spanning nodes (True); None when there is no such group."""
    values = [largest(g)[op] for g in groups.values() if g["spans_nodes"] == across_nodes for op in PLANNER_OPS]
    return statistics.median(values) if values else None


def bandwidth_file(groups: dict, grid: Grid) -> dict:
    """The figures the planner reads (`python -m utils.plan --bandwidths FILE`), in its exact format."""
    return {"kind": "dlscale-bandwidths", "version": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "device": device_name(grid.device), "backend": "nccl" if grid.device.type == "cuda" else "gloo",
            "world": grid.world_size, "intra_gbs": link_gbs(groups, False), "inter_gbs": link_gbs(groups, True),
            "groups": {name: {"size": g["size"], "spans_nodes": g["spans_nodes"], "busbw_gbs": largest(g)}
                       for name, g in groups.items()}}


def planner_hardware(device: torch.device) -> tuple[str, Hardware] | None:
    """The planner's preset for this device (gpu=h100 for H100/H200/GH200, a100, cpu), or None if it has none."""
    if device.type != "cuda":
        return "cpu", GPUS["cpu"]
    name = device_name(device).upper()
    for key, preset in (("A100", "a100"), ("H100", "h100"), ("H200", "h100")):
        if key in name:
            return preset, GPUS[preset]
    return None


def bandwidth_status(ratio: float, achievable: float, min_fraction: float) -> str:
    """pass at the fraction of the nominal link a healthy one reaches, warn down to `min_fraction`, fail below."""
    return "pass" if ratio >= achievable else "warn" if ratio >= min_fraction else "fail"


def bandwidth_checks(groups: dict, device: torch.device, min_fraction: float) -> list[Check]:
    """A line per axis: values right, and the measured busbw against the planner's assumed (nominal) link: pass
    at ACHIEVABLE_FRACTION of it, fail below `min_fraction` of it, warn between."""
    if not groups:
        return [Check("bandwidth", "collectives", "pass", "no axis above one rank: nothing to measure")]
    preset = planner_hardware(device)
    checks = []
    for name, g in groups.items():
        wrong = sorted({op for row in g["sizes"].values() for op, fig in row.items() if not fig["ok"]})
        figures = largest(g)
        where = "across nodes" if g["spans_nodes"] else "inside a node"
        text = ", ".join(f"{op} {v:.2f}" for op, v in figures.items())
        checks.append(Check("bandwidth", f"{name} ({g['size']} ranks, {where}): values", "fail" if wrong else "pass",
                            f"wrong values from {', '.join(wrong)}" if wrong else "every op delivered the right values",
                            {"wrong": wrong}))
        measured = statistics.mean(figures[op] for op in PLANNER_OPS)
        if preset is None:
            checks.append(Check("bandwidth", f"{name}: busbw GB/s", "warn", f"{text}; the planner has no preset for "
                                "this device", {"busbw_gbs": figures}))
            continue
        assumed = preset[1].inter_gbs if g["spans_nodes"] else preset[1].intra_gbs
        ratio, achievable = measured / assumed, ACHIEVABLE_FRACTION[where]
        status = bandwidth_status(ratio, achievable, min_fraction)
        checks.append(Check("bandwidth", f"{name}: busbw GB/s vs planner gpu={preset[0]}", status,
                            f"{text}; all-gather/reduce-scatter {measured:.3g} = {ratio:.2g} x the {assumed:g} "
                            f"the planner assumes {where} (a healthy link reaches {achievable:.2g} x)",
                            {"busbw_gbs": figures, "assumed_gbs": assumed, "ratio": ratio, "achievable": achievable}))
    return checks
