"""python -m utils.plan.rank [key=value ...] --world N [--rank R] [--vocab V] [--steps S] [--json]

Play one rank of a cluster-sized job on this machine, for real: rank R of N on torch's fake process group
(collectives return at once, without data; torchtitan dry-runs memory the same way) builds and initialises
exactly its share of the model with the real build (utils/engine/build.py: meta build, its tp/pp/FSDP
pieces allocated and drawn), then takes one real training step (forward, backward, Adam) on random tokens.
It prints what the rank holds, its peak host memory after the build and after the step, and the seconds
to each. The values the fake collectives would have brought are garbage; the memory and the time of the
rank's own work are the job's.

    python -m utils.plan.rank model=llama_8b parallel.dp_mode=fsdp --world 8 --rank 3 --vocab 128256
    python -m utils.plan.rank model=llama_8b parallel.tp=2 parallel.dp_mode=fsdp --world 64 --vocab 128256

--vocab: the tokenizer's vocabulary when no data is read (default: as `python -m utils.plan` takes it, from the
data's tokenizer when it can be read without the corpus, else the model preset's published one, else GPT-2's 50257;
utils/plan/workload.py).
--steps: training steps after the build (default 1; 0: the build alone).
The data settings still shape the batch (data.seq_len, trainer.global_batch_size).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from utils import ConfigError, require, tool_main


def parse(argv: list[str]) -> tuple[list[str], dict]:
    """(config overrides, options) of the command line."""
    options = {"world": None, "rank": 0, "vocab": None, "steps": 1, "json": False}
    overrides, args = [], iter(argv)
    for arg in args:
        if arg == "--json":
            options["json"] = True
        elif arg.startswith("--") and arg[2:] in options:
            value = next(args, None)
            require(value is not None and value.isdigit(), f"{arg} needs a number", arg, f"write {arg} N")
            options[arg[2:]] = int(value)
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option {arg}", arg, "use --world, --rank, --vocab, --steps or --json")
        else:
            overrides.append(arg)
    require(options["world"] is not None and options["world"] >= 1, "the world size is missing", "--world",
            "give --world N, the number of ranks of the job")
    require(0 <= options["rank"] < options["world"], f"rank {options['rank']} of {options['world']}", "--rank",
            f"give a rank from 0 to {options['world'] - 1}")
    return overrides, options


def play(overrides: list[str], world: int, rank: int, vocab: int | None, steps: int = 1) -> dict:
    """Build rank `rank` of `world` and take `steps` steps (0: the build only); the figures (see the module
    docstring)."""
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.engine.build import build_trainer, param_bytes_report
    from utils.engine.memory import host_peak_gib, reset_host_peak
    from utils.plan.probe import data_less_task
    from utils.plan.step import check_batch_for, fake_world
    from utils.plan.workload import resolve_vocab

    cfg, choices, _ = load_config(overrides)
    # torch's pipelining agrees on static shapes by a vote its stages send down the pipeline: on the fake group
    # it arrives as zeros, and the shape exchange that follows needs real messages
    require(cfg.parallel.pp == 1, "a pipeline rank cannot be played on the fake process group", "parallel.pp",
            "plan the layout with python -m utils.plan (its rank holding the most), or play parallel.pp=1")
    vocab, vocab_from = resolve_vocab(cfg, choices.get("model"), vocab)
    task = data_less_task(cfg, vocab)
    with fake_world(world, rank), tempfile.TemporaryDirectory() as tmp:
        grid = init_grid(cfg.parallel)
        check_batch_for(cfg, grid)
        reset_host_peak()
        t0 = time.perf_counter()
        trainer = build_trainer(cfg, task, grid, logging.getLogger("dlscale.plan"), Path(tmp))
        built_s, built_gib = time.perf_counter() - t0, host_peak_gib()
        x, y = task.example_batch(cfg.trainer.global_batch_size // grid.batch.size, grid.device)
        for _ in range(steps):
            trainer.train_step(x, y)
        step_s, step_gib = time.perf_counter() - t0 - built_s, host_peak_gib()
        held = param_bytes_report(trainer.raw_model, trainer.optimizer)
        trainer.tb.close()
    return {"layout": grid.name, "rank": rank, "world": world, "held": held, "build_s": round(built_s, 1),
            "build_host_peak_gib": round(built_gib, 2), "steps": steps, "steps_s": round(step_s, 1),
            "steps_host_peak_gib": round(step_gib, 2), "vocab": vocab, "vocab_from": vocab_from}


def report(argv: list[str]) -> str:
    """The command's output: the figures of `play` as a line, or as JSON (--json)."""
    overrides, options = parse(argv)
    figures = play(overrides, options["world"], options["rank"], options["vocab"], options["steps"])
    if options["json"]:
        return json.dumps(figures)
    return (f"{figures['layout']} rank {figures['rank']} of {figures['world']}: {figures['held']}; built in "
            f"{figures['build_s']} s (peak host memory {figures['build_host_peak_gib']} GiB), "
            f"{figures['steps']} step(s) {figures['steps_s']} s later (peak {figures['steps_host_peak_gib']} GiB)"
            + (f"; vocabulary {figures['vocab']} ({figures['vocab_from']})" if figures["vocab"] else ""))


def main(argv: list[str] | None = None) -> int:
    return tool_main(__doc__, argv, report)


if __name__ == "__main__":
    sys.exit(main())
