"""A checkpoint of any layout as one torch.save file of the single-process state, and back.

    python -m utils.checkpoints.export export runs/<run>/checkpoints/step_0000100 model.pt
    python -m utils.checkpoints.export import model.pt runs/<new run>      # -> runs/<new run>/checkpoints/step_0000100

The file holds plain tensors of the one-process model, readable without this project:

    {"model": state_dict,                                  torch.nn.Module.load_state_dict(file["model"])
     "optimizer": {name: {"exp_avg", "exp_avg_sq", "step"}}, Adam's state per parameter name
     "trainer": {"step", "samples", "lr", "scaler", ...}}

Export reads the checkpoint in one process (every shard, any layout; the per-rank RNG states are left out).
Import writes a complete checkpoint (DCP folder, state.json, marker, `latest`) that any layout resumes with
`trainer.resume=auto run.dir=<new run>` or `trainer.resume=<its step folder>`; random streams are then
re-derived from (seed, step, rank), as for a checkpoint of another layout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from utils import ConfigError, exit_bad_input
from utils.checkpoints.checkpointer import Checkpointer
from utils.checkpoints.sharded_state import read_full
from utils.comm import Grid

IMPORTED = "imported from a single-process file"  # the `layout` an imported checkpoint records


def export_checkpoint(folder: Path, out: Path) -> dict:
    """Write the single-process state of the checkpoint `folder` to `out`; returns it."""
    checkpointer = Checkpointer(folder.parent.parent, Grid.serial().world)
    if not checkpointer.is_complete(folder):
        raise ConfigError(f"{folder} is not a complete checkpoint", "CHECKPOINT",
                          "give a step_* folder that holds a COMPLETE marker")
    state = {"model": {}, "optimizer": {}, "trainer": checkpointer.read_meta(folder)}
    for key, tensor in read_full(folder).items():
        kind, _, rest = key.partition("/")
        if kind == "model":
            state["model"][rest] = tensor
        elif kind == "optim":
            name, _, entry = rest.rpartition("/")
            state["optimizer"].setdefault(name, {})[entry] = tensor
    torch.save(state, out)
    return state


def import_checkpoint(file: Path, run_dir: Path) -> Path:
    """Write the state of an exported `file` as a checkpoint of `run_dir`; returns its step folder."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not {"model", "optimizer", "trainer"} <= state.keys():
        raise ConfigError(f"{file} is not a file written by `python -m utils.checkpoints.export export`", "FILE",
                          "export a checkpoint first (it holds model, optimizer and trainer)")
    tensors = {f"model/{name}": t for name, t in state["model"].items()}
    tensors.update({f"optim/{name}/{entry}": t for name, entries in state["optimizer"].items()
                    for entry, t in entries.items()})
    meta = {**state["trainer"], "layout": IMPORTED}
    return Checkpointer(run_dir, Grid.serial().world).save(int(meta["step"]), tensors, meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.checkpoints.export", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("export", help="checkpoint folder -> one torch.save file")
    out.add_argument("checkpoint", type=Path)
    out.add_argument("file", type=Path)
    back = sub.add_parser("import", help="torch.save file -> a checkpoint of a run directory")
    back.add_argument("file", type=Path)
    back.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            state = export_checkpoint(args.checkpoint, args.file)
            count = sum(t.numel() for t in state["model"].values())
            print(f"wrote {args.file}: step {state['trainer']['step']}, {len(state['model'])} model tensors "
                  f"({count / 1e6:.2f}M values), Adam state of {len(state['optimizer'])} parameters")
        else:
            print(f"wrote {import_checkpoint(args.file, args.run_dir)}")
    except ConfigError as err:
        exit_bad_input(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
