"""The figures of `python -m utils.compare --out DIR` (utils/compare/report.py): loss against step and against
wall-clock time, throughput per run, and throughput against ranks. A run is shown by its label: the settings
that tell it apart from the other runs compared (utils/compare/settings.py), or its name.
"""

from __future__ import annotations

from pathlib import Path


def plot_loss(plt, runs: list, path: Path, against_time: bool) -> None:
    """Train loss solid, validation loss dashed, one colour per run (report.py's `Run`s, by label); x = step or
    seconds since start."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        for tag, style, what in (("train/loss", "-", "train"), ("val/loss", "--", "val")):
            curve = run.curves.get(tag, [])
            if curve:
                x = [t if against_time else step for step, t, _ in curve]
                ax.plot(x, [v for _, _, v in curve], style, color=colour, label=f"{run.label} {what}",
                        marker="o" if what == "val" else None, markersize=3)
    ax.set_xlabel("wall-clock time since the run's first event (s)" if against_time else "step")
    ax.set_ylabel("loss")
    ax.set_title("loss against " + ("wall-clock time" if against_time else "step"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(plt, rows: list[dict[str, object]], path: Path) -> None:
    """Median samples/s per run, one bar each."""
    shown = [row for row in rows if row["samples_per_sec"] is not None]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.45 * max(len(shown), 1)))
    bars = ax.barh([row["label"] for row in shown], [row["samples_per_sec"] for row in shown])
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("samples/s (median over the logged steps)")
    ax.set_title("throughput per run")
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(plt, rows: list[dict[str, object]], path: Path) -> None:
    """Median samples/s against ranks, and ideal linear scaling from the smallest run (its best
    throughput when several runs share the smallest rank count)."""
    from matplotlib import ticker

    shown = [row for row in rows if row["samples_per_sec"] is not None]
    fig, ax = plt.subplots(figsize=(7, 5))
    if shown:
        smallest = min(row["ranks"] for row in shown)
        base = max(row["samples_per_sec"] for row in shown if row["ranks"] == smallest)
        ranks = sorted({row["ranks"] for row in shown})
        ax.plot(ranks, [base * n / smallest for n in ranks], "k--",
                label=f"ideal linear scaling from {smallest} rank(s)")
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # each run's colour in the loss figures
        for i, row in enumerate(rows):
            if row["samples_per_sec"] is None:
                continue
            text = row["label"] if row["layout"] in row["label"] else f"{row['label']} ({row['layout']})"
            ax.plot(row["ranks"], row["samples_per_sec"], "o", color=colours[i % len(colours)],
                    label=text)  # in the legend: labels beside points overlap
        ax.set_xscale("log", base=2)  # log-log: ideal scaling is a straight line
        ax.set_yscale("log")
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("ranks")
    ax.set_ylabel("samples/s (median)")
    ax.set_title("throughput against ranks")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_figures(out: Path, runs: list, rows: list[dict[str, object]]) -> list[str]:
    """The PNG figures in `out`; their file names. matplotlib is imported here, for --out only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_loss(plt, runs, out / "loss_vs_step.png", against_time=False)
    plot_loss(plt, runs, out / "loss_vs_time.png", against_time=True)
    plot_throughput(plt, rows, out / "throughput.png")
    names = ["loss_vs_step.png", "loss_vs_time.png", "throughput.png"]
    if len({row["ranks"] for row in rows}) > 1:
        plot_scaling(plt, rows, out / "scaling.png")
        names.append("scaling.png")
    return names
