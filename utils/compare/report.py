"""Compare runs side by side: `python -m utils.compare RUN_DIR... [--out DIR]`
(and where two runs part: `--diverge RUN_A RUN_B`, utils/compare/diverge.py).

Prints a markdown table with one row per run directory: the settings that differ between the runs
(utils/compare/settings.py), layout and ranks, precision, steps, final and best train and validation loss, the
task's headline metric (val/ppl for the language model, val/rmse/u10m for the ViT), medians of the throughput
figures, peak memory, and the communication bytes per step of each axis. With `--out DIR` it also writes
DIR/compare.md, DIR/compare.csv and figures (utils/compare/figures.py): loss against step and against wall-clock
time, throughput per run, and (when the runs differ in rank count) throughput against ranks with ideal linear
scaling from the smallest run, each run labelled by the settings that tell it apart. A glob's folders that are
not runs (a sweep point that crashed before its first event) are named in a warning and skipped; a glob without
a run, or a path given alone that is not one, is an error.

Everything is read from what a run leaves in its directory: config.yaml (precision, settings), presets.json
(the presets chosen), layout.json (the resolved layout of its last launch, utils/checkpoints/run_dir.py),
task.json (the metric the run is judged by: its column) and every TensorBoard event file (a resumed run has one
per launch; the last value written for a step wins). Medians are over whatever points a tag has.
Only the standard library is imported at the top, so `--help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from utils import ConfigError, exit_bad_input, require
from utils.compare.figures import write_figures
from utils.compare.settings import Settings, compare_settings, more_note

Curve = list[tuple[int, float, float]]  # (step, seconds since the run's first event, value), by step
COMM_TAG = re.compile(r"comm/(.+)_bytes")
AXIS_ORDER = ("tp", "cp", "dp", "pp")  # comm columns in this order; axis products after them
NOTE = ("samples/s, tokens/s, TFLOP/s per rank, MFU and bytes/step: medians over the logged steps; "
        "peak mem: the largest mem/peak_gib; best loss: the lowest finite value.")


@dataclass(frozen=True)
class Column:
    key: str  # the CSV header
    header: str  # the markdown header
    fmt: Callable[[object], str]  # markdown cell of a value (CSV cells hold the full value)


def _num(spec: str) -> Callable[[object], str]:
    return lambda value: format(value, spec)


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


COLUMNS = (
    Column("run", "run", str), Column("layout", "layout", str), Column("ranks", "ranks", str),
    Column("precision", "precision", str), Column("steps", "steps", str),
    Column("train_loss_final", "train loss", _num(".5g")), Column("train_loss_best", "best train loss", _num(".5g")),
    Column("val_loss_final", "val loss", _num(".5g")), Column("val_loss_best", "best val loss", _num(".5g")),
    Column("samples_per_sec", "samples/s", _num(".1f")), Column("tokens_per_sec", "tokens/s", _num(".0f")),
    Column("tflops_per_sec", "TFLOP/s per rank", _num(".3g")), Column("mfu", "MFU", _num(".1%")),
    Column("peak_mem_gib", "peak mem GiB", _num(".2f")),
)
QUALITY_AFTER = "val_loss_best"  # each run's quality metric (its task.json) gets a column after this one


@dataclass
class Run:
    """What one run directory holds, as read by `load_run`."""

    name: str
    layout: str  # e.g. 'tp2 x dp2' (axes of size > 1 in grid order) or 'single'
    ranks: int
    precision: str
    curves: dict[str, Curve]  # every scalar tag
    quality: str | None = None  # the TensorBoard tag of the task's quality metric (task.json), if recorded
    config: dict[str, object] | None = None  # config.yaml, flat ({"optim.lr": 0.001, ...})
    presets: dict[str, str | None] | None = None  # presets.json, if recorded
    label: str = ""  # what tells it apart from the other runs compared (utils/compare/settings.py), or its name


# ---------------------------------------------------------------------------------------------- reading

def run_dirs(patterns: list[str]) -> tuple[list[Path], list[str]]:
    """The run directories the arguments name (globs expanded, sorted), checked before anything is read, and a
    warning for each folder a glob matched that is not a run (skipped). A glob that matches no run at all, and a
    path given alone that is not one, are refused."""
    dirs: list[Path] = []
    skipped: list[str] = []
    for arg in patterns:
        matches = sorted(glob.glob(arg))
        is_glob = any(c in arg for c in "*?[")
        require(bool(matches), f"{arg!r} " + ("matches nothing" if is_glob else "does not exist"), "RUN_DIR",
                "give run directories that train.py wrote (its run.dir), or a glob of them: 'outputs/*'")
        problems = {path: not_a_run(path) for path in map(Path, matches)}
        runs = [path for path, problem in problems.items() if problem is None]
        if not runs:
            path, problem = next(iter(problems.items()))
            raise ConfigError(f"{path} is not a run directory: {problem}" if not is_glob else
                              f"{arg!r} matches no run directory ({path}: {problem})", "RUN_DIR",
                              "give a directory that train.py wrote (its run.dir), or a glob that matches some")
        skipped += [f"warning: skipped {path}, matched by {arg!r}: not a run directory ({problem})"
                    for path, problem in problems.items() if problem is not None]
        dirs += [path for path in runs if path not in dirs]
    return dirs, skipped


def not_a_run(path: Path) -> str | None:
    """Why `path` is not a run directory, or None when it is one."""
    if not path.is_dir():
        return "it is not a directory"
    missing = [what for what, ok in (("config.yaml", (path / "config.yaml").is_file()),
                                     ("TensorBoard events", any(path.glob("events.out.tfevents.*")))) if not ok]
    return f"it has no {' and no '.join(missing)}" if missing else None


def read_curves(run_dir: Path) -> dict[str, Curve]:
    """Every scalar tag of the run's event files: the last value written for each step, in step order,
    timed in seconds since the run's first event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 1, "tensors": 1})
    acc.Reload()
    try:
        start = acc.FirstEventTimestamp()
    except ValueError:  # event files without a single event (a run stopped before its first step)
        return {}
    curves = {}
    for tag in acc.Tags()["scalars"]:
        points = {e.step: (e.wall_time - start, e.value) for e in acc.Scalars(tag)}
        curves[tag] = [(step, *points[step]) for step in sorted(points)]
    return curves


def layout_of(run_dir: Path, parallel: dict) -> tuple[str, int]:
    """('tp2 x dp2', 4): the resolved layout of the run's last launch, from its layout.json. A run directory
    from before layout.json: config.yaml's parallel section by the project's rules (utils.comm,
    utils.cli.launch), a derived dp (parallel.dp=0) as the one rank a one-process start gives it."""
    from types import SimpleNamespace

    from utils.checkpoints.run_dir import read_layout

    facts = read_layout(run_dir)
    if facts is not None:
        return str(facts["name"]).replace("-", " x "), int(facts["world_size"])
    from utils.cli.launch import ranks_needed
    from utils.comm import Axis, layout_name, parse_order

    sizes = {axis: max(int(parallel.get(axis.value, 1)), 1) for axis in Axis}
    ranks = ranks_needed(SimpleNamespace(**{axis.value: size for axis, size in sizes.items()}))
    name = layout_name(sizes, parse_order(parallel.get("order", "tp-cp-dp-pp")))
    return name.replace("-", " x "), ranks


def load_run(run_dir: Path, name: str) -> Run:
    from omegaconf import OmegaConf

    from utils.checkpoints.run_dir import PRESETS_FILE, TASK_FILE, flat_config, read_facts

    text = (run_dir / "config.yaml").read_text()
    config = OmegaConf.to_container(OmegaConf.create(text))
    layout, ranks = layout_of(run_dir, config.get("parallel") or {})
    precision = (config.get("precision") or {}).get("mode", "")
    task = read_facts(run_dir, TASK_FILE) or {}
    return Run(name, layout, ranks, precision, read_curves(run_dir), task.get("quality_metric"), flat_config(text),
               read_facts(run_dir, PRESETS_FILE), name)


def run_names(dirs: list[Path]) -> list[str]:
    """Directory names, or the paths as given where two runs share a name."""
    names = [d.resolve().name for d in dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, dirs)]


# ----------------------------------------------------------------------------------------------- the table

def run_row(run: Run) -> dict[str, object]:
    """One table row: column key -> value (None where the run did not log it)."""
    def values(tag: str) -> list[float]:
        return [value for _, _, value in run.curves.get(tag, [])]

    def final(tag: str) -> float | None:
        return values(tag)[-1] if values(tag) else None

    def best(tag: str) -> float | None:  # a skipped step's loss can be inf or nan
        finite = [v for v in values(tag) if math.isfinite(v)]
        return min(finite) if finite else None

    def median(tag: str) -> float | None:
        return statistics.median(values(tag)) if values(tag) else None

    losses = run.curves.get("train/loss", [])
    row = {"run": run.name, "layout": run.layout, "ranks": run.ranks, "precision": run.precision,
           "steps": losses[-1][0] if losses else None,
           "train_loss_final": final("train/loss"), "train_loss_best": best("train/loss"),
           "val_loss_final": final("val/loss"), "val_loss_best": best("val/loss"),
           **({quality_key(run.quality): final(run.quality)} if run.quality else {}),
           "samples_per_sec": median("perf/samples_per_sec"), "tokens_per_sec": median("perf/tokens_per_sec"),
           "tflops_per_sec": median("perf/tflops_per_sec"), "mfu": median("perf/mfu"),
           "peak_mem_gib": max(values("mem/peak_gib"), default=None)}
    for tag in run.curves:
        if match := COMM_TAG.fullmatch(tag):
            row[f"comm_{match[1]}_bytes"] = median(tag)
    return row


def quality_key(tag: str) -> str:
    """The column key of a quality metric: 'val/rmse/u10m' -> 'val_rmse_u10m'."""
    return tag.replace("/", "_")


def label_runs(runs: list[Run]) -> Settings:
    """The settings that differ between the runs (table columns), each run's label set from them."""
    settings = compare_settings([r.config for r in runs], [r.presets for r in runs], [r.layout for r in runs],
                                [r.precision for r in runs], [r.name for r in runs])
    for run, label in zip(runs, settings.labels):
        run.label = label
    return settings


def table_columns(runs: list[Run], rows: list[dict[str, object]], settings: list[str] = ()) -> list[Column]:
    """The run's name, the `settings` that differ between the runs, the fixed columns, each run's quality metric
    after the losses, then one per axis with traffic."""
    columns = [COLUMNS[0], *(Column(key, key, str) for key in settings), *COLUMNS[1:]]
    tags = dict.fromkeys(tag for run in runs if (tag := run.quality))  # first seen first
    at = [c.key for c in columns].index(QUALITY_AFTER) + 1
    columns[at:at] = [Column(quality_key(tag), tag, _num(".4g")) for tag in tags]
    axes = {key[len("comm_"):-len("_bytes")] for row in rows for key in row if key.startswith("comm_")}
    for axis in sorted(axes, key=lambda a: (AXIS_ORDER.index(a) if a in AXIS_ORDER else len(AXIS_ORDER), a)):
        columns.append(Column(f"comm_{axis}_bytes", f"{axis} bytes/step", _bytes))
    return columns


def markdown_table(rows: list[dict[str, object]], columns: list[Column]) -> str:
    def cell(row, column):
        value = row.get(column.key)
        return "" if value is None else column.fmt(value)

    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---" if c.fmt is str else "---:" for c in columns) + "|"]
    lines += ["| " + " | ".join(cell(row, c) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, object]], columns: list[Column]) -> None:
    """Full values (floats as Python writes them: they read back exactly); empty where absent."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c.key for c in columns], extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c.key: "" if row.get(c.key) is None else row[c.key] for c in columns} for row in rows)


# ------------------------------------------------------------------------------------------------ the entry

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m utils.compare", description="Compare training runs: one markdown table row per run.",
        epilog="Example: python -m utils.compare 'outputs/vit_tiny-*' --out compare/")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories written by train.py (run.dir), or globs of them (expanded here)")
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="also write DIR/compare.md, DIR/compare.csv and PNG figures")
    parser.add_argument("--diverge", action="store_true",
                        help="RUN_A RUN_B: the first step, pass and module where two runs recorded with "
                             "trainer.fingerprint_steps=N part (utils/compare/diverge.py); exit 1 if they do")
    parser.add_argument("--rtol", type=float, metavar="R",
                        help="with --diverge: the relative tolerance (default: that of the runs' precision)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.diverge:
        from utils.compare.diverge import report

        if len(args.runs) != 2 or args.out is not None:
            exit_bad_input(ConfigError(f"--diverge takes two run directories, got {len(args.runs)}"
                                       + (" and --out" if args.out is not None else ""), "--diverge",
                                       "python -m utils.compare --diverge RUN_A RUN_B"))
        return report(*args.runs, args.rtol)
    try:
        dirs, skipped = run_dirs(args.runs)
        require(args.out is None or not args.out.exists() or args.out.is_dir(), f"{args.out} is a file", "--out",
                "give a directory (created if missing)")
    except ConfigError as err:
        exit_bad_input(err)
    for warning in skipped:
        print(warning, file=sys.stderr)
    runs = [load_run(d, name) for d, name in zip(dirs, run_names(dirs))]
    settings = label_runs(runs)
    rows = [{**run_row(run), **values} for run, values in zip(runs, settings.values)]
    columns = table_columns(runs, rows, settings.columns)
    report = "\n".join(filter(None, [markdown_table(rows, columns), more_note(settings)])) + "\n\n" + NOTE
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "compare.csv", rows, columns)
        figures = write_figures(args.out, runs, [{**row, "label": run.label} for run, row in zip(runs, rows)])
        links = "\n".join(f"![{name[:-4].replace('_', ' ')}]({name})" for name in figures)
        (args.out / "compare.md").write_text(f"# Run comparison\n\n{report}\n\n{links}\n")
        print(f"wrote {args.out}/compare.md, compare.csv, {', '.join(figures)}", file=sys.stderr)
    return 0
