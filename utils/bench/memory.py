"""python -m utils.bench.memory [key=value ...] [--layout NAME=SETTINGS ...] [--resume NAME] [--init-from DIR]
[--out DIR]

The memory table of a model: each layout trained for 3 of 4 steps, ending with a checkpoint, through train_mp.py; then
the first layout's checkpoint resumed under `--resume`'s layout (the load phase) and, with `--init-from`, a
Hugging Face folder imported under it; every rank's peak host memory at the end of each phase is read from
the runs' memory.json (utils/engine/memory.py) and set beside the rank's share of the model's training
state, 16 bytes per parameter (fp32 weights, gradients, Adam's two moments) divided by the ranks, plus the
runtime's fixed overhead: the peak of the same one-process run of a model of one narrow block (Python,
torch, the data, the communication buffers; measured first), plus, under FSDP, the blocks it holds gathered
at its backward peak: the block being differentiated, its unsharded gradient and the next block prefetched,
3 x the largest block's fp32 weights over tp (utils/plan/fsdp.py `gathered_peak` counts them exactly).

    python -m utils.bench.memory model=gpt_medium data=wikitext_sample data.seq_len=64 data.limit_eval_tokens=512 \\
        --layout fsdp4="parallel.dp=4 parallel.dp_mode=fsdp" --layout tp2dp2="parallel.tp=2 parallel.dp_mode=fsdp" \\
        --resume fsdp4

A layout's SETTINGS are overrides separated by spaces; `single` (one process) is always measured first. A run
ends with a validation pass: bound it (data.limit_eval_tokens, data.limit_nsamples_val) for a large model on a
small machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from utils import ConfigError, require, tool_main

COMMON = ["trainer.max_steps=4", "trainer.stop_at_step=3", "trainer.ckpt_every=3", "trainer.val_every=0",
          "trainer.val_at_start=false",
          "trainer.num_workers=0", "trainer.log_every=1", "trainer.global_batch_size=8"]


def parse(argv: list[str]) -> tuple[list[str], dict[str, list[str]], dict]:
    overrides, layouts, options, args = [], {"single": []}, {"resume": None, "init_from": None, "out": None}, iter(argv)
    for arg in args:
        if arg == "--layout":
            name, _, settings = (next(args, "") or "").partition("=")
            require(bool(name) and bool(settings), "--layout needs NAME=SETTINGS", "--layout",
                    'write --layout tp2="parallel.tp=2"')
            layouts[name] = settings.split()
        elif arg.replace("-", "_").lstrip("_") in options and arg.startswith("--"):
            options[arg.lstrip("-").replace("-", "_")] = next(args, None)
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {arg}", arg, "use --layout, --resume, --init-from or --out")
        else:
            overrides.append(arg)
    require(options["resume"] is None or options["resume"] in layouts, f"--resume {options['resume']} is no layout",
            "--resume", "name a --layout")
    return overrides, layouts, options


def run(overrides: list[str], run_dir: Path) -> dict:
    """One train_mp.py run; its memory.json (raises with the run's last lines when it fails)."""
    done = subprocess.run([sys.executable, "train_mp.py", *overrides, f"run.dir={run_dir}"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"train_mp.py {' '.join(overrides)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads((run_dir / "memory.json").read_text())["host"]


def parameters(overrides: list[str]) -> int:
    """The model's parameter count (a meta build)."""
    from utils.cli.config import load_config
    from utils.tasks import build_task

    cfg, _, _ = load_config(overrides)
    with torch.device("meta"):
        return sum(p.numel() for p in build_task(cfg).build_model().parameters())


def gathered_gib(overrides: list[str]) -> float:
    """FSDP's gathered blocks at a rank's backward peak (see the module docstring); 0 without FSDP."""
    from utils.cli.config import load_config
    from utils.tasks import build_task

    cfg, _, _ = load_config(overrides)
    if cfg.parallel.dp_mode != "fsdp":
        return 0.0
    with torch.device("meta"):
        blocks = build_task(cfg).build_model().blocks.children()
    return 3 * max(4 * sum(p.numel() for p in b.parameters()) for b in blocks) / cfg.parallel.tp / 2**30


def table(rows: list[tuple[str, dict]], params: int, overhead: float, worlds: dict[str, int],
          gathered: dict[str, float]) -> str:
    lines = [f"model parameters: {params / 1e6:.1f}M, training state 16 B each = {16 * params / 2**30:.2f} GiB; "
             f"runtime overhead (one process, one narrow block): {overhead:.2f} GiB", "",
             "| run | ranks | share + overhead (+ FSDP's gathered blocks) (GiB) | peak host memory per rank by phase "
             "(GiB) | largest / expected |", "|---|---|---|---|---|"]
    for name, host in rows:
        world = worlds[name]
        expected = 16 * params / 2**30 / world + overhead + gathered[name]
        held = f"{expected:.2f}" + (f" (of it {gathered[name]:.2f})" if gathered[name] else "")
        phases = "; ".join(f"{phase} " + " ".join("-" if v is None else f"{v:.2f}" for v in values)
                           for phase, values in host.items() if phase != "end")
        largest = max(v for values in host.values() for v in values if v is not None)
        lines.append(f"| {name} | {world} | {held} | {phases} | {largest / expected:.2f} |")
    return "\n".join(lines)


def measure(overrides: list[str], layouts: dict[str, list[str]], options: dict, out: Path) -> str:
    from utils.cli.config import load_config
    from utils.cli.launch import ranks_needed

    tiny = ["model.depth=1", "model.embed_dim=64", "model.num_heads=4"]
    if hasattr(load_config(overrides)[0].model, "num_kv_heads"):
        tiny += ["model.num_kv_heads=0", "model.mlp_hidden=0"]
    overhead = run([*overrides, *COMMON, *tiny, "trainer.ckpt_every=0"], out / "overhead")["end"][0]
    worlds = {name: ranks_needed(load_config([*overrides, *settings])[0].parallel)
              for name, settings in layouts.items()}
    gathered = {name: gathered_gib([*overrides, *settings]) for name, settings in layouts.items()}
    rows = [(name, run([*overrides, *COMMON, *settings], out / name)) for name, settings in layouts.items()]
    if options["resume"]:
        source = next(name for name in layouts if name != options["resume"])
        ckpt = out / source / "checkpoints" / "step_0000003"
        name = f"{options['resume']} resumes {source}"
        worlds[name], gathered[name] = worlds[options["resume"]], gathered[options["resume"]]
        rows.append((name, run([*overrides, *COMMON, *layouts[options["resume"]], "trainer.stop_at_step=null",
                                "trainer.ckpt_every=0", f"trainer.resume={ckpt}"], out / "resumed")))
        if options["init_from"]:
            name = f"{options['resume']} imports {Path(options['init_from']).name}"
            worlds[name], gathered[name] = worlds[options["resume"]], gathered[options["resume"]]
            rows.append((name, run([*overrides, *COMMON, *layouts[options["resume"]], "trainer.ckpt_every=0",
                                    f"trainer.init_from={options['init_from']}"], out / "imported")))
    return table(rows, parameters(overrides), overhead, worlds, gathered)


def report(argv: list[str]) -> str:
    overrides, layouts, options = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return measure(overrides, layouts, options, Path(options["out"] or tmp))


def main(argv: list[str] | None = None) -> int:
    return tool_main(__doc__, argv, report)


if __name__ == "__main__":
    sys.exit(main())
