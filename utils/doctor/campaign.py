"""The GPU campaign: `python -m utils.doctor --campaign [--dry-run] [--out DIR] [--seed-dir PATH] [--budget-s S]`.

One prepared command for whenever a GPU node is at hand (docs/gpu_campaign.md). In at most `--budget-s` seconds
(600) it records the environment (Python, torch, CUDA, cuDNN, NCCL, the driver, every GPU's name, memory, SMs and
compute capability), then runs, each as a process of its own with a time limit, so one failure or hang does not
stop the rest:
1. the `pytest -m gpu` tier (tests/test_gpu_*.py: the ring's kernels against the math path; with 2 GPUs or more
   the parallel layers and mappings against their serial twins on NCCL, FSDP2 and the pipeline);
2. the doctor (environment, layers, mappings, bandwidth, the layout's curve against the single device, MFU) on
   vit_base in bf16: `parallel.tp=2` with 2 GPUs or more, one device otherwise;
3. `python -m utils.bench` for vit_base and gpt_small in bf16, without and with `precision.compile` (samples/s,
   TFLOP/s, MFU); with `--seed-dir` (a checkout of NERSC/sc24-dl-tutorial) vit_base's rows also time the
   tutorial's own ViT at the same shape, for a same-run ratio.
It writes `campaign.md` and `campaign.json` (`kind: dlscale-gpu-campaign`) in `--out` (default
outputs/campaign/<UTC time>/), each step's command, status, seconds, its parsed figures and its output's tail.

`--dry-run` (the suite runs it on the CPU): the same steps at tiny sizes (vit_tiny, gpt_tiny at 32 tokens, one or two
timed steps, the doctor without the bandwidth sweep); the compiled benchmarks are listed, not run (compiling on the CPU
takes minutes). The exit status is 0 when every step that ran passed, else 1; 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from utils import require

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_gpu_*.py"))
BUDGET_S = 600.0  # the whole campaign on a GPU node
TAIL = 3000  # characters of each step's output kept in the report
OPTIONS = ("--dry-run", "--out", "--seed-dir", "--budget-s")


@dataclasses.dataclass
class Step:
    """One campaign step: a command (after `python`), its time limit, and whether it runs or is only listed."""

    name: str
    argv: list[str]
    timeout_s: float
    run: bool = True
    why: str = ""  # why a listed step does not run


def parse(argv: list[str]) -> dict:
    """{'--dry-run': bool, '--out': Path | None, '--seed-dir': Path | None, '--budget-s': float}."""
    options, it = {"--dry-run": False, "--out": None, "--seed-dir": None, "--budget-s": BUDGET_S}, iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        require(key in OPTIONS, f"unknown campaign option '{arg}'", arg, "use " + ", ".join(OPTIONS))
        if key == "--dry-run":
            options[key] = True
            continue
        value = value if eq else next(it, "")
        if key == "--budget-s":
            require(value.replace(".", "", 1).isdigit() and float(value) > 0, f"bad --budget-s '{value}'", key,
                    "give a positive number of seconds")
            options[key] = float(value)
            continue
        require(bool(value), f"{key} needs a folder", key, f"give {key} DIR")
        options[key] = Path(value)
    seed = options["--seed-dir"]
    require(seed is None or (seed / "networks").is_dir(), f"no NERSC tutorial checkout at '{seed}'", "--seed-dir",
            "give a checkout of NERSC/sc24-dl-tutorial (its networks/ folder), or leave --seed-dir out")
    return options


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bench_steps(dry_run: bool, seed_dir: Path | None) -> list[Step]:
    """utils.bench for vit_base and gpt_small in bf16, eager and compiled (tiny twins in the dry run)."""
    steps = []
    models = {"vit": ["model=vit_tiny"] if dry_run else ["model=vit_base"],
              "gpt": ["model=gpt_tiny", "data=wikitext_sample", "data.seq_len=32"] if dry_run else
                     ["model=gpt_small", "data=wikitext_sample", "data.seq_len=1024"]}
    # the dry run's batch of 4: gpt_tiny's output layer at a batch of 16 takes about 8 s a step in bf16 on an
    # AVX2-only CPU (no bf16 matrix kernels), where checking that the step runs is all the dry run is for
    timing = ["--warmup", "1", "--steps", "1", "trainer.global_batch_size=4"] if dry_run else \
        ["--warmup", "3", "--steps", "10"]
    for family, model in models.items():
        for compile_ in (False, True):
            seed = ["--seed-dir", str(seed_dir)] if seed_dir is not None and family == "vit" else []
            steps.append(Step(f"bench {model[0].split('=')[1]} bf16{' compile' if compile_ else ''}",
                              ["-m", "utils.bench", *model, "precision=bf16",
                               f"precision.compile={str(compile_).lower()}",
                               *timing, *seed], 240 if compile_ else 120, run=not (dry_run and compile_),
                              why="compiling on the CPU takes minutes" if dry_run and compile_ else ""))
    return steps


def plan(dry_run: bool, gpus: int, out: Path, seed_dir: Path | None = None) -> list[Step]:
    """The campaign's steps for a node with `gpus` GPUs (the dry run: the same at tiny sizes on the CPU)."""
    pytest_step = Step("pytest -m gpu", ["-m", "pytest", "-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                                         *GPU_TESTS], 60 if dry_run else 200)
    layout = ["parallel.tp=2"] if gpus >= 2 else []
    model = ["model=vit_tiny", "--steps", "1", "--timed-steps", "1", "--skip", "bandwidth"] if dry_run else \
        ["model=vit_base"]
    doctor = Step(f"doctor {'tp2' if layout else 'single device'}", ["-m", "utils.doctor", *model, *layout,
                                                                     "precision=bf16", "--out", str(out / "doctor")],
                  90 if dry_run else 180)
    return [pytest_step, doctor, *bench_steps(dry_run, seed_dir)]


def _command(argv: list[str]) -> str:
    return " ".join(["python", *argv])


def driver_facts() -> dict:
    """The driver version and GPUs as `nvidia-smi` reports them, or why not."""
    if shutil.which("nvidia-smi") is None:
        return {"driver": "unknown (no nvidia-smi)"}
    proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total,pci.bus_id",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
    rows = [line.split(", ") for line in proc.stdout.strip().splitlines()]
    return {"driver": rows[0][0] if rows else f"unknown ({proc.stderr.strip()[:200]})", "nvidia_smi": rows}


def environment() -> dict:
    """Versions and devices, read in this process (no step can hide them)."""
    from utils.engine.flops import device_model

    facts = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda or "none", "cudnn": str(torch.backends.cudnn.version() or "none"),
             "nccl": "none", "gpus": [], **driver_facts()}
    if gpu_count():
        facts["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    for i in range(gpu_count()):
        p = torch.cuda.get_device_properties(i)
        facts["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sms":
                              p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
                              "peak_table": device_model(torch.device("cuda", i))})
    return facts


def table_rows(text: str) -> list[dict[str, str]]:
    """The markdown table rows a step printed (utils.bench's), as {column: value} by the table's header."""
    rows, header = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None or set("".join(cells)) <= set("-: "):
            continue
        if header is None or cells[0] == "date" or len(cells) != len(header):
            header = cells if cells[0] == "date" else header
            continue
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def figures(step: Step, text: str, out: Path) -> dict:
    """What a step measured: the doctor's verdict counts, the benchmarks' rows, pytest's summary line."""
    if step.name.startswith("doctor") and (out / "doctor" / "report.json").exists():
        checks = json.loads((out / "doctor" / "report.json").read_text()).get("checks", [])
        statuses = [c.get("status") for c in checks]
        return {"checks": len(checks), **{s: statuses.count(s) for s in ("pass", "warn", "fail")},
                "failed": [c.get("name") for c in checks if c.get("status") == "fail"]}
    if step.name.startswith("bench"):
        return {"rows": table_rows(text)}
    summary = [line for line in text.splitlines() if " passed" in line or " skipped" in line or " failed" in line]
    return {"summary": summary[-1].strip("= ") if summary else ""}


def run_step(step: Step, out: Path, deadline: float) -> dict:
    """Run one step within its limit and the campaign's deadline: its record for the report."""
    record = {"name": step.name, "command": _command(step.argv), "status": "listed", "seconds": 0.0}
    left = deadline - time.monotonic()
    if not step.run or left < 10:
        return {**record, "why": step.why or f"not run: the campaign's budget had {left:.0f} s left"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *step.argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=min(step.timeout_s, left), check=False)
        text, status = proc.stdout + proc.stderr, "pass" if proc.returncode == 0 else f"fail (exit {proc.returncode})"
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
        status = f"timeout ({min(step.timeout_s, left):.0f} s)"
    record.update(status=status, seconds=round(time.monotonic() - start, 1), tail=text[-TAIL:],
                  figures=figures(step, text, out))
    return record


def markdown(report: dict) -> str:
    """campaign.md: the facts, a line per step, the benchmarks' rows."""
    env = report["environment"]
    gpus = [f"- GPU {i}: {g['name']}, {g['memory_gib']} GiB, {g['sms']} SMs, sm {g['capability']}, peak table "
            f"{g['peak_table']}" for i, g in enumerate(env["gpus"])] or ["- no GPU (a dry run on the CPU)"]
    lines = [f"# GPU campaign, {report['date']}{' (dry run)' if report['dry_run'] else ''}", "",
             (f"- host {env['host']}, Python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, "
              f"cuDNN {env['cudnn']}, NCCL {env['nccl']}, driver {env['driver']}"), *gpus,
             f"- commit {report['commit']}, {report['seconds']:.0f} s of {report['budget_s']:.0f}", "",
             "| step | status | seconds | command | figures |", "|---|---|---|---|---|"]
    for s in report["steps"]:
        fig = s.get("figures", {})
        short = fig.get("summary") or ", ".join(f"{k} {v}" for k, v in fig.items() if k in ("pass", "warn", "fail")) \
            or "; ".join(f"{r.get('samples/s')} samples/s, MFU {r.get('MFU')}" for r in fig.get("rows", []))
        short = short or s.get("why", "")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | `{s['command']}` | {short} |")
    rows = [r for s in report["steps"] for r in s.get("figures", {}).get("rows", [])]
    if rows:
        keys = ["device", "model", "precision", "compile", "samples/s", "TFLOP/s per device", "MFU", "peak GiB"]
        lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(r.get(k, "") for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def run_campaign(options: dict) -> tuple[dict, Path]:
    """Every step in order within the budget; (the report, its folder)."""
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = options["--out"] or ROOT / "outputs" / "campaign" / stamp.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + options["--budget-s"]
    gpus = 0 if options["--dry-run"] else gpu_count()
    report = {"kind": "dlscale-gpu-campaign", "version": 1, "date": stamp.isoformat(timespec="seconds"),
              "dry_run": options["--dry-run"], "commit": commit(), "budget_s": options["--budget-s"],
              "environment": environment(), "steps": []}
    for step in plan(options["--dry-run"], gpus, out, options["--seed-dir"]):
        report["steps"].append(run_step(step, out, deadline))
        print(f"campaign: {step.name}: {report['steps'][-1]['status']}", flush=True)
    report["seconds"] = round(time.monotonic() - start, 1)
    (out / "campaign.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "campaign.md").write_text(markdown(report))
    return report, out


def campaign_main(argv: list[str]) -> int:
    """The command line: exit 0 when every step that ran passed, 1 otherwise, 2 for bad input."""
    options = parse(argv)
    require(options["--dry-run"] or gpu_count() > 0, "no GPU on this machine", "--campaign",
            "run it on a GPU node, or add --dry-run for the tiny CPU rehearsal")
    report, out = run_campaign(options)
    print(markdown(report), flush=True)
    print(f"campaign: report {out / 'campaign.md'} and campaign.json", flush=True)
    return 0 if all(s["status"] in ("pass", "listed") for s in report["steps"]) else 1
