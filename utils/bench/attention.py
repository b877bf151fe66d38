"""Time one layer's context-parallel attention against plain SDPA: `python -m utils.bench.attention`.

    python -m utils.bench.attention [--shape vit_base] [--cp N] [--cp-a2a A] [--tokens T] [--batch B]
                                    [--dtype fp32|bf16|fp16] [--causal] [--warmup W] [--iters I]
                                    [--overlap [--trace-dir DIR]]

The shape is a model preset's: heads and head dim from config/model/<shape>.yaml, the sequence the tokens of
the seed's 360x720 ERA5 image at its patch size (vit_base: 8 heads of 48, 45 x 90 = 4,050 tokens);
`--tokens` replaces the length (a small one runs on CPU in seconds). Started as one process with `--cp` > 1
it starts cp local ranks of itself (torchrun's variables, one GPU each where there are enough, else CPU
processes on gloo) and rank 0 prints a markdown table: for each `parallel.cp_attention` variant the median
forward + backward time of one layer's attention (batch B, this rank's 1/cp of the tokens, every head of
the layer), its ratio to plain SDPA over the whole sequence on one device (ideal: 1/cp), and the bytes
this rank sent on the cp axis per forward + backward (counted by distributed/, the README's formulas). A
variant the shape does not allow (alltoall: heads a multiple of cp; hierarchical: cp >= 4 with cp_a2a
dividing cp and the heads) is printed as such. Autocast is not used: the inputs are in `--dtype`.

`--overlap` (the ring only) measures whether each hop's transfer runs under the block computation, in
forward and in backward: it times every `ring_shift` of the ring (issue, wait start, wait end), the same
transfers alone (issued and waited at once), and profiles one step with torch.profiler (a Chrome trace per
rank in `--trace-dir`). It prints the transfer time alone, the time the ring waited for it, the share
hidden under compute (1 - wait / alone) and, from the trace, the time gloo's send/recv were in flight
while an aten operator ran on the main thread. docs/measurements.md has the figures.
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from distributed.device import synchronize
from utils import ConfigError, exit_bad_input, require
from utils.cli.launch import die_with_parent, free_port, rank_env
from utils.cli.local_launch import supervise
from utils.comm import Axis, destroy_grid, init_grid
from utils.engine.flops import device_name
from utils.launch_env import launch_env
from utils.schema import CP_VARIANTS, ParallelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEED_IMAGE = (360, 720)  # the seed's ERA5 crop (config/data/era5.yaml)
OPTIONS = {"--shape": "vit_base", "--cp": "1", "--cp-a2a": "2", "--tokens": "0", "--batch": "1", "--dtype": "",
           "--warmup": "2", "--iters": "5", "--trace-dir": ""}
FLAGS = ("--causal", "--overlap")


def parse_options(argv: list[str]) -> dict:
    """The options as values, every unknown one refused in one line."""
    options, it = dict(OPTIONS) | dict.fromkeys(FLAGS, False), iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        require(key in OPTIONS or key in FLAGS, f"unknown option {key}", key,
                "see python -m utils.bench.attention's docstring: " + " ".join([*OPTIONS, *FLAGS]))
        options[key] = True if key in FLAGS else (value if eq else next(it, ""))
    for key in ("--cp", "--cp-a2a", "--tokens", "--batch", "--warmup", "--iters"):
        require(options[key].isdigit(), f"bad {key} value '{options[key]}'", key, "give a whole number")
        options[key] = int(options[key])
    require(options["--cp"] >= 1 and options["--iters"] >= 1, "--cp and --iters must be at least 1", "--cp",
            "give --cp 1 or more")
    dtype = options["--dtype"] or ("bf16" if torch.cuda.is_available() else "fp32")
    require(dtype in DTYPES, f"unknown --dtype {dtype}", "--dtype", "choose " + ", ".join(DTYPES))
    options["--dtype"] = DTYPES[dtype]
    return options


def layer_shape(shape: str, tokens: int) -> tuple[int, int, int]:
    """(heads, head dim, tokens) of one attention layer of model preset `shape` on the seed's image."""
    from utils.cli.config import load_config

    try:
        model = load_config([f"model={shape}", "data=era5"])[0].model
    except ConfigError as err:
        raise ConfigError(f"--shape {shape} is not a ViT preset ({err})", "--shape",
                          "use a ViT preset (vit_tiny, vit_base, vit_large) and --tokens for other lengths") from None
    image_tokens = (SEED_IMAGE[0] // model.patch_size) * (SEED_IMAGE[1] // model.patch_size)
    return model.num_heads, model.embed_dim // model.num_heads, tokens or image_tokens


def unusable(variant: str, heads: int, cp: int, a2a: int) -> str | None:
    """Why `variant` cannot run this shape at this cp (the config's own rules), or None."""
    if variant == "alltoall" and heads % cp:
        return f"{heads} heads not a multiple of cp={cp}"
    if variant == "hierarchical" and not (cp >= 4 and cp % a2a == 0 and 1 < a2a < cp and heads % a2a == 0):
        return f"needs cp >= 4 split in groups of cp_a2a={a2a} that divide cp and the heads"
    return None


def time_step(step, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of `step()` (a forward + backward) over `iters` runs after `warmup`."""
    times = []
    for i in range(warmup + iters):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def inputs(batch: int, heads: int, n: int, d: int, dtype, device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, heads, n, d, generator=gen, device=device, dtype=dtype) for _ in range(4)]


def attention_step(attend, q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: attend(*leaves).backward(grad)


def variant_rows(options: dict, grid, heads: int, d: int, n: int) -> list[tuple]:
    """(variant, ms, bytes sent per forward + backward, or the reason it cannot run) for each variant."""
    from distributed.context.attention import ContextParallelAttention
    from distributed.context.layout import ContextShards

    axis, causal, cp = grid.axis(Axis.CP), options["--causal"], grid.size(Axis.CP)
    shards = ContextShards(axis, balanced=causal)
    shards.enter(n, grid.device)
    full = inputs(options["--batch"], heads, n, d, options["--dtype"], grid.device, seed=0)
    local = [shards.shard(t, 2) for t in full]
    rows = []
    for variant in CP_VARIANTS:
        if why := unusable(variant, heads, cp, options["--cp-a2a"]):
            rows.append((variant, None, None, why))
            continue
        hierarchy = grid.cp_hierarchy if variant == "hierarchical" else None
        attention = ContextParallelAttention(shards, causal, variant, hierarchy=hierarchy)
        step = attention_step(attention, *local)
        before = axis.bytes_moved
        step()
        sent = axis.bytes_moved - before
        rows.append((variant, time_step(step, grid.device, options["--warmup"], options["--iters"]), sent, None))
    sdpa = attention_step(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal), *full)
    rows.append(("plain SDPA (one device)", time_step(sdpa, grid.device, options["--warmup"], options["--iters"]),
                 0, None))
    return rows


def table(options: dict, rows: list[tuple], heads: int, d: int, n: int, cp: int, device: torch.device) -> str:
    sdpa = rows[-1][1]
    dtype = str(options["--dtype"]).removeprefix("torch.")
    lines = [f"{options['--shape']} attention layer: batch {options['--batch']}, {heads} heads x {d}, {n} tokens "
             f"({'causal' if options['--causal'] else 'non-causal'}), {dtype}, cp={cp}; "
             f"{device_name(device)}, {datetime.date.today()}",
             "| cp_attention | forward + backward ms | x plain SDPA | bytes sent per rank |", "|---|---:|---:|---:|"]
    for variant, seconds, sent, why in rows:
        if why:
            lines.append(f"| {variant} | n/a: {why} | | |")
        else:
            lines.append(f"| {variant} | {seconds * 1e3:.2f} | {seconds / sdpa:.2f} | {sent:,} |")
    return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def trace_overlap(events, phase: str) -> tuple[float, float]:
    """(ms the transfers were in flight, ms of that while an aten operator ran on the main thread) within the
    profiled `phase` event (_RingAttention: forward; _RingAttentionBackward: backward)."""
    outer = next(e for e in events if e.name == phase)
    span = outer.time_range
    inside = [e for e in events if span.start <= e.time_range.start and e.time_range.end <= span.end]
    comm = _union([(e.time_range.start, e.time_range.end) for e in inside if e.name.split(":")[0] in ("gloo", "nccl")])
    compute = _union([(e.time_range.start, e.time_range.end) for e in inside
                      if e.name.startswith("aten::") and e.thread == outer.thread])
    return sum(b - a for a, b in comm) / 1e3, _overlap(comm, compute) / 1e3


def timed_ring_steps(attention, leaves: list[torch.Tensor], grad: torch.Tensor, warmup: int, iters: int) -> list:
    """Run forward + backward `warmup + iters` times with every `ring_shift` of the ring timed; the records of
    the last `iters`: [phase, issue time, wait start, wait end, the tensors sent, shapes, tag]."""
    from distributed.context import ring

    phase, shifts, real_shift = ["forward"], [], ring.ring_shift

    def timed_shift(tensors, axis, shapes, tag=0):
        record = [phase[0], time.perf_counter(), 0.0, 0.0, [t.clone() for t in tensors], shapes, tag]
        wait = real_shift(tensors, axis, shapes, tag)

        def timed_wait():
            record[2] = time.perf_counter()
            got = wait()
            record[3] = time.perf_counter()
            return got
        shifts.append(record)
        return timed_wait

    ring.ring_shift = timed_shift
    try:
        for i in range(warmup + iters):
            if i == warmup:
                shifts.clear()
            phase[0] = "forward"
            out = attention(*leaves)
            phase[0] = "backward"
            out.backward(grad)
    finally:
        ring.ring_shift = real_shift
    return shifts


def overlap_rows(shifts: list, alone: list[float], iters: int, cp: int) -> list[str]:
    """Table rows per phase and what travels: hops per step, ms alone, ms waited, the share hidden."""
    from distributed.context.ring import GRAD_TAG, KV_TAG

    grads = [i for i, r in enumerate(shifts) if r[6] == GRAD_TAG]
    home = set(grads[cp - 1::cp])  # each step's last dK/dV hop: waited after the last block, nothing to hide it
    kinds = (("K/V", lambda i, r: r[6] == KV_TAG), ("dK/dV under the blocks", lambda i, r: r[6] == GRAD_TAG
             and i not in home), ("dK/dV home, after the last block", lambda i, r: i in home))
    rows = []
    for name in ("forward", "backward"):
        for what, keep in kinds:
            mine = [(r, a) for i, (r, a) in enumerate(zip(shifts, alone)) if r[0] == name and keep(i, r)]
            if mine:
                alone_s, waited_s = sum(a for _, a in mine) / iters, sum(r[3] - r[2] for r, _ in mine) / iters
                rows.append(f"| {name} | {what} | {len(mine) // iters} | {alone_s * 1e3:.2f} | {waited_s * 1e3:.2f} "
                            f"| {max(0.0, 1 - waited_s / alone_s):.0%} |")
    return rows


def measure_overlap(options: dict, grid, heads: int, d: int, n: int) -> str:
    """The ring's transfers against its block computation (module doc, `--overlap`)."""
    from torch.profiler import ProfilerActivity, profile

    from distributed.collectives import ring_shift
    from distributed.context.attention import ContextParallelAttention
    from distributed.context.layout import ContextShards

    axis, causal, iters = grid.axis(Axis.CP), options["--causal"], options["--iters"]
    shards = ContextShards(axis, balanced=causal)
    shards.enter(n, grid.device)
    local = [shards.shard(t, 2) for t in inputs(options["--batch"], heads, n, d, options["--dtype"], grid.device, 0)]
    attention = ContextParallelAttention(shards, causal, "ring")
    leaves = [t.detach().requires_grad_() for t in local[:3]]
    shifts = timed_ring_steps(attention, leaves, local[3], options["--warmup"], iters)
    alone = []
    for record in shifts:  # every rank issues the same transfers in the same order: each one alone now
        start = time.perf_counter()
        ring_shift(record[4], axis, record[5], record[6])()
        alone.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention(*leaves).backward(local[3])
    if options["--trace-dir"]:
        prof.export_chrome_trace(f"{options['--trace-dir']}/ring_rank{grid.rank(Axis.CP)}.json")
    events = list(prof.events())
    lines = [f"ring at cp={axis.size}: batch {options['--batch']}, {heads} heads x {d}, {n} tokens, "
             f"{str(options['--dtype']).removeprefix('torch.')}; {device_name(grid.device)}, {datetime.date.today()}; "
             f"per step, mean of {iters}", "| phase | what travels | transfers | alone ms | waited ms "
             "| hidden under compute |", "|---|---|---:|---:|---:|---:|",
             *overlap_rows(shifts, alone, iters, axis.size),
             "", "one profiled step (torch.profiler):", "| phase | gloo send/recv open ms "
             "| of it while an aten op ran ms |", "|---|---:|---:|"]
    for name, event in (("forward", "_RingAttention"), ("backward", "_RingAttentionBackward")):
        lines.append(f"| {name} | %.2f | %.2f |" % trace_overlap(events, event))
    return "\n".join(lines)


def run_rank(options: dict) -> int:
    cp, a2a = options["--cp"], options["--cp-a2a"]
    heads, d, n = layer_shape(options["--shape"], options["--tokens"])
    multiple = 2 * cp if options["--causal"] else cp
    require(n % multiple == 0 or not options["--causal"] and n >= cp, f"{n} tokens cannot be split over cp={cp}"
            + (" in 2 x cp equal chunks" if options["--causal"] else ""), "--tokens", f"use a multiple of {multiple}")
    hierarchical = unusable("hierarchical", heads, cp, a2a) is None
    grid = init_grid(ParallelConfig(cp=cp, cp_attention="hierarchical" if hierarchical else "ring", cp_a2a=a2a))
    if options["--overlap"]:
        report = measure_overlap(options, grid, heads, d, n)
    else:
        report = table(options, variant_rows(options, grid, heads, d, n), heads, d, n, cp, grid.device)
    if grid.rank(Axis.CP) == 0 and launch_env().rank == 0:
        print(report, flush=True)
    return 0


def launch_ranks(argv: list[str], world: int) -> int:
    """Start `world` local ranks of this command (torchrun's variables); the first failing status, else 0."""
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "utils.bench.attention", *argv],
                              env=rank_env(r, world, port, use_gpus), preexec_fn=die_with_parent)
             for r in range(world)]
    return supervise(procs)  # a failing rank stops the others


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options = parse_options(argv)
        layer_shape(options["--shape"], options["--tokens"])  # a bad shape refused before any rank starts
        if launch_env().source == "single" and options["--cp"] > 1:
            return launch_ranks(argv, options["--cp"])
        return run_rank(options)
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()


if __name__ == "__main__":
    sys.exit(main())
