"""Multiple-choice evaluation of a language model: a checkpoint of any layout, or a Hugging Face folder.

    python -m utils.evaluate runs/<run> --task items.jsonl           # its newest complete step
    python -m utils.evaluate runs/<run>/checkpoints/step_0000100 --task items.jsonl
    python -m utils.evaluate hf/<name> --task items.jsonl --normalize bytes --batch 16 --output results.json
    torchrun --nproc-per-node 4 -m utils.evaluate hf/<name> --task items.jsonl --tp 2 --pp 2

The items' format is utils/evaluate/items.py's (one JSON object a line: context, choices, answer); the scoring
utils/evaluate/scoring.py's (each choice's log-likelihood given the context, summed or normalized by tokens or
bytes). A run directory, its checkpoints/ or checkpoints/latest stands for the step folder it names (the newest
complete one; the step taken is printed on stderr). The source is opened as every tool opens a model
(utils/engine/session.py): in one process, the run's model settings and tokenizer (as `python -m utils.generate`
reads them) and every shard of any layout; launched on several ranks, built tensor and pipeline parallel as
training builds it (`Opened.sharded`), tp x pp = the ranks.
Prints the accuracy with its standard error (rank 0); `--output FILE` writes it and every item's scores and
prediction as JSON. Bad input (a missing folder, a bad line of the items: its number and what is wrong, ...):
one line on stderr, exit 2, before any work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from utils import ConfigError, exit_bad_input, require
from utils.comm import ends_its_grid
from utils.evaluate.items import build_requests, read_items
from utils.evaluate.scoring import NORMALIZE, choice_scores, log_likelihoods, summarize
from utils.generate.command import open_source
from utils.launch_env import launch_env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m utils.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path, help="a run directory (its newest complete step), a step_* folder of its "
                   "checkpoints/, or a Hugging Face model folder")
    p.add_argument("--task", type=Path, required=True, help="a JSON Lines file of multiple-choice items")
    p.add_argument("--normalize", choices=NORMALIZE, default="sum",
                   help="a choice's score: its summed log-likelihood, per token (length) or per UTF-8 byte (bytes)")
    p.add_argument("--batch", type=int, default=8, help="sequences (context + one choice) per forward")
    p.add_argument("--output", type=Path, help="write the accuracy and every item's scores here (JSON)")
    p.add_argument("--tp", type=int, default=0, help="launched on several ranks: tensor-parallel degree "
                   "(default: the ranks / --pp)")
    p.add_argument("--pp", type=int, default=1, help="launched on several ranks: pipeline stages")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder or tokenizer.json (default: the source's)")
    p.add_argument("--data", nargs="*", default=[], metavar="data.KEY=VALUE",
                   help="where the run's corpus now lies (its word or BPE tokenizer is cached there)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="one process only")
    return p


def check_args(args) -> None:
    require(args.batch > 0, f"--batch {args.batch}", "--batch", "give a positive number of sequences")
    require(args.pp > 0 and args.tp >= 0, f"--tp {args.tp} --pp {args.pp}", "--tp", "give positive degrees")
    require(launch_env().world_size > 1 or args.tp <= 1 and args.pp == 1,
            f"--tp {args.tp} --pp {args.pp} in one process", "--tp",
            "launch the ranks with torchrun --nproc-per-node N -m utils.evaluate ...")


def load(args):
    """(model, tokenizer, device, width multiple, whether this rank prints): one process or this rank's part."""
    world = launch_env().world_size
    opened, tokenizer = open_source(args)
    if world == 1:
        return opened.serial(args.device), tokenizer, torch.device(args.device), 1, True
    tp = args.tp or world // args.pp
    require(tp * args.pp == world, f"--tp {tp} x --pp {args.pp} is not the launch's {world} ranks", "--tp",
            f"give --tp and --pp whose product is {world}")
    model, grid = opened.sharded(tp=tp, pp=args.pp)
    return model, tokenizer, grid.device, tp, grid.is_main


@ends_its_grid()
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_args(args)
        items = read_items(args.task)
        model, tokenizer, device, multiple, main_rank = load(args)
        requests = build_requests(items, tokenizer, model.cfg.max_positions, args.task)
    except ConfigError as err:
        exit_bad_input(err)
    start = time.perf_counter()
    loglik = log_likelihoods(model, requests, args.batch, device, multiple)
    seconds = time.perf_counter() - start
    result = summarize(items, choice_scores(items, requests, loglik, args.normalize))
    if not main_rank:
        return 0
    n, spread = result.num_items, f"+- {result.stderr:.4f}"
    if result.accuracy in (0.0, 1.0):  # sqrt(p (1 - p) / n) is 0 there: the rule of three bounds it instead
        spread = f"({'above' if result.accuracy else 'below'} {abs(result.accuracy - min(1.0, 3 / n)):.4f} at 95%)"
    print(f"accuracy {result.accuracy:.4f} {spread} ({n} items, normalize={args.normalize})")
    print(f"{len(requests)} choices scored in {seconds:.2f} s", file=sys.stderr)
    if args.output is not None:
        args.output.write_text(json.dumps({"accuracy": result.accuracy, "stderr": result.stderr,
                                           "items": result.num_items, "normalize": args.normalize,
                                           "per_item": result.per_item}, indent=1) + "\n")
    return 0
