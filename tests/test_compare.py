"""utils/compare/report.py on three real runs of train.py's tiny ViT: one process, two-rank data parallel, two-rank
tensor parallel.

The table's values are checked against the runs' TensorBoard events as tests.helpers.read_scalars reads
them, the CSV against the table, the figures as PNG files; then globs, bad arguments and a resumed run's
several event files.
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys

import pytest

from tests.helpers import ROOT, read_scalars
from tests.rank_pool import run_entry_ranks
from utils.compare.report import layout_of, main, read_curves

TINY = ["trainer.max_steps=4", "trainer.val_every=2", "trainer.log_every=2", "trainer.ckpt_every=0",
        "trainer.num_workers=0", "trainer.global_batch_size=8", "data.limit_nsamples_val=8", "trainer.log_images=false"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["loss_vs_step.png", "loss_vs_time.png", "throughput.png"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, era5_root):
    """{'single': run dir (1 rank), 'dp2': run dir (2 ranks, parallel.dp derived: 0 in its config.yaml),
    'tp2': run dir (2 ranks)}: train.py's command lines on the rank pool's ranks as torchrun starts them
    (tests/rank_pool.py), which write what a launched run writes."""
    root = tmp_path_factory.mktemp("runs")
    layouts = {"single": ([], 1), "dp2": (["parallel=dp"], 2), "tp2": (["parallel=tp2"], 2)}
    for name, (layout, world) in layouts.items():
        results = run_entry_ranks([f"data.root={era5_root}", f"run.dir={root / name}", *TINY, *layout], world)
        failed = [r for r in results if r.value != 0]
        assert not failed, failed[0].error or failed[0].stdout[-2000:] + failed[0].stderr[-3000:]
    return {name: root / name for name in layouts}


def table_rows(text: str) -> list[dict[str, str]]:
    """The markdown table of compare's output as {header: cell} per row."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    headers = [h.strip() for h in lines[0].strip("|").split("|")]
    return [dict(zip(headers, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


@pytest.mark.slow
def test_table_values_are_those_of_the_events(runs, capsys):
    assert main([str(runs["single"]), str(runs["dp2"]), str(runs["tp2"])]) == 0
    rows = {row["run"]: row for row in table_rows(capsys.readouterr().out)}
    assert list(rows) == ["single", "dp2", "tp2"]  # the order of the arguments
    assert (rows["single"]["layout"], rows["single"]["ranks"]) == ("single", "1")
    assert (rows["dp2"]["layout"], rows["dp2"]["ranks"]) == ("dp2", "2")  # dp=0 in config.yaml: from layout.json
    assert (rows["tp2"]["layout"], rows["tp2"]["ranks"]) == ("tp2", "2")
    for name, run_dir in runs.items():
        scalars, row = read_scalars(run_dir), rows[name]
        losses = [v for _, v in scalars["train/loss"]]
        assert row["steps"] == "4" and row["precision"] == "fp32"
        assert float(row["train loss"]) == pytest.approx(losses[-1], rel=1e-4)
        assert float(row["best train loss"]) == pytest.approx(min(losses), rel=1e-4)
        assert float(row["val loss"]) == pytest.approx(scalars["val/loss"][-1][1], rel=1e-4)
        assert float(row["val/rmse/u10m"]) == pytest.approx(scalars["val/rmse/u10m"][-1][1], rel=1e-3)
        samples = statistics.median(v for _, v in scalars["perf/samples_per_sec"])
        assert float(row["samples/s"]) == pytest.approx(samples, abs=0.051)
        assert row["MFU"] == ""  # CPU: no known peak
        assert "val/ppl" not in row  # no language model among these runs
    assert rows["single"]["dp bytes/step"] == "" and rows["dp2"]["dp bytes/step"].endswith("MiB")
    assert rows["tp2"]["dp bytes/step"] == "" and rows["tp2"]["tp bytes/step"].endswith("MiB")
    assert rows["dp2"]["tp bytes/step"] == ""


@pytest.mark.slow
def test_out_writes_the_table_csv_and_figures(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(runs["single"]), str(runs["dp2"]), str(runs["tp2"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() in (out / "compare.md").read_text()
    with (out / "compare.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["run"] for r in csv_rows] == [r["run"] for r in table_rows(printed)] == ["single", "dp2", "tp2"]
    for row, run_dir in zip(csv_rows, runs.values()):  # full values: equal to the events' own
        scalars = read_scalars(run_dir)
        losses = [v for _, v in scalars["train/loss"]]
        assert (float(row["train_loss_final"]), float(row["train_loss_best"])) == (losses[-1], min(losses))
        assert float(row["val_loss_best"]) == min(v for _, v in scalars["val/loss"])
        assert float(row["samples_per_sec"]) == statistics.median(v for _, v in scalars["perf/samples_per_sec"])
        assert float(row["peak_mem_gib"]) == max(v for _, v in scalars["mem/peak_gib"])
        assert int(row["steps"]) == scalars["train/loss"][-1][0] and row["mfu"] == ""
    assert [r["ranks"] for r in csv_rows] == ["1", "2", "2"]
    assert csv_rows[0]["comm_dp_bytes"] == "" and float(csv_rows[1]["comm_dp_bytes"]) == statistics.median(
        v for _, v in read_scalars(runs["dp2"])["comm/dp_bytes"])
    for name in [*FIGURES, "scaling.png"]:  # the ranks differ: the scaling figure too
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in (out / "compare.md").read_text()

    assert main([str(runs["single"]), "--out", str(tmp_path / "one")]) == 0
    assert sorted(p.name for p in (tmp_path / "one").glob("*.png")) == sorted(FIGURES)  # one rank count


@pytest.mark.slow
def test_a_glob_expands_sorted(runs, capsys):
    assert main([str(runs["single"].parent / "*")]) == 0
    assert [row["run"] for row in table_rows(capsys.readouterr().out)] == ["dp2", "single", "tp2"]


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["nothing-*", "missing_dir", "not_a_run", "a_file"])
def test_a_bad_argument_is_one_line_and_status_2_before_any_work(bad, runs, tmp_path, capsys):
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([str(runs["single"]), str(tmp_path / bad), "--out", str(out)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and bad in lines[0], captured.err
    assert "give" in lines[0] and not out.exists()  # the fix, and nothing written


def test_help_answers_without_loading_the_heavy_modules():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "utils.compare", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "RUN_DIR" in proc.stdout and "--out" in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "tensorboard", "matplotlib", "omegaconf", "numpy"}, imported


def test_layout_from_layout_json_or_from_an_old_runs_config(tmp_path):
    """layout.json (the last launch's resolved layout) gives the layout, a derived dp included; a run directory
    from before layout.json: config.yaml's explicit sizes in grid order, a derived dp as one rank."""
    from utils.checkpoints.run_dir import write_layout
    from utils.comm import Grid, parse_order, resolve_sizes
    from utils.schema import ParallelConfig

    parallel = {"tp": 2, "cp": 1, "pp": 1, "dp": 2, "order": "tp-cp-dp-pp"}
    assert layout_of(tmp_path, parallel) == ("tp2 x dp2", 4)
    assert layout_of(tmp_path, {**parallel, "order": "dp-tp-cp-pp"}) == ("dp2 x tp2", 4)
    assert layout_of(tmp_path, {**parallel, "dp": 0}) == ("tp2", 2)
    (tmp_path / "train.log").write_text("... INFO grid: world=4 tp=2 cp=1 dp=2 pp=1 order=tp-cp-dp-pp; run.dir: x\n")
    assert layout_of(tmp_path, {**parallel, "dp": 0}) == ("tp2", 2)  # log text is never read
    write_layout(tmp_path, Grid(resolve_sizes(ParallelConfig(tp=2), 8), parse_order("tp-cp-dp-pp")))
    assert layout_of(tmp_path, {**parallel, "dp": 0}) == ("tp2 x dp4", 8)


def test_a_resumed_run_keeps_the_last_value_of_each_step(tmp_path):
    """Two launches into one directory (two event files), the second redoing steps 3-4 after a crash."""
    from torch.utils.tensorboard import SummaryWriter

    for first, values, purge in ((1, [1.0, 0.9, 0.8, 0.7], None), (3, [0.5, 0.4, 0.3], 3)):
        writer = SummaryWriter(log_dir=str(tmp_path), purge_step=purge)
        for step, value in enumerate(values, start=first):
            writer.add_scalar("train/loss", value, step)
        writer.close()
    curve = read_curves(tmp_path)["train/loss"]
    assert [(step, value) for step, _, value in curve] == [(1, 1.0), (2, pytest.approx(0.9)), (3, 0.5),
                                                           (4, pytest.approx(0.4)), (5, pytest.approx(0.3))]
    assert 0 <= curve[0][1] <= curve[-1][1] < 60  # seconds since the first event


def test_a_launch_in_the_same_second_is_read_after_the_one_it_resumes(tmp_path):
    """TensorBoard reads a directory's event files in name order, and names start with their second. The first
    launch wrote steps 1-5 and crashed after its checkpoint at 3; its file, stamped a second ahead with a pid that
    sorts last as text (a launch in this same second from another process, or this process's writer 99 before
    its 100), must still be read before the resumed one's, whose steps 4-5 replace the crashed ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from utils.engine.logger import TensorBoard

    writer = SummaryWriter(log_dir=str(tmp_path))
    for step, value in enumerate([1.0, 0.9, 0.8, 0.7, 0.6], start=1):
        writer.add_scalar("train/loss", value, step)
    writer.close()
    (made,) = tmp_path.glob("events.out.tfevents.*")
    parts = made.name.split(".")  # events, out, tfevents, second, host (may hold dots), pid, counter
    prefix, stamp, host = ".".join(parts[:3]), int(parts[3]), ".".join(parts[4:-2])
    made.rename(tmp_path / f"{prefix}.{stamp + 1:010d}.{host}.99999999.99")
    resumed = TensorBoard(tmp_path, is_main=True, start_step=3)
    for step, value in ((4, 0.5), (5, 0.4)):
        resumed.scalars({"train/loss": value}, step)
    resumed.close()
    assert [(step, value) for step, _, value in read_curves(tmp_path)["train/loss"]] == [
        (1, 1.0), (2, pytest.approx(0.9)), (3, pytest.approx(0.8)), (4, 0.5), (5, pytest.approx(0.4))]
    shown = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0}).Reload().Scalars("train/loss")
    assert [e.step for e in shown] == [1, 2, 3, 4, 5]  # what TensorBoard draws, in its order


def fake_run(folder, *overrides: str, presets: bool = True, losses=(1.0, 0.8, 0.6)):
    """A run directory as train.py leaves it, without training: config.yaml of `overrides`, presets.json (unless
    left out, as by a run from before it), and TensorBoard events of a few steps."""
    from torch.utils.tensorboard import SummaryWriter

    from utils.checkpoints.run_dir import PRESETS_FILE, preset_facts, write_facts
    from utils.cli.config import load_config

    folder.mkdir(parents=True)
    _, choices, config_yaml = load_config(list(overrides))
    (folder / "config.yaml").write_text(config_yaml)
    if presets:
        write_facts(folder, PRESETS_FILE, preset_facts(choices))
    writer = SummaryWriter(log_dir=str(folder))
    for step, value in enumerate(losses, start=1):
        writer.add_scalar("train/loss", value, step)
        writer.add_scalar("perf/samples_per_sec", 10.0 * step, step)
    writer.close()
    return folder


def test_a_glob_skips_a_crashed_point_with_a_warning(tmp_path, capsys):
    """A sweep point that crashed before its first event leaves only train.log: a glob names it in one warning line
    and compares the others; the folder alone, or a glob of such folders only, is still refused."""
    sweep = tmp_path / "sweep"
    fake_run(sweep / "0", "optim.lr=5e-4")
    fake_run(sweep / "2", "optim.lr=2e-3")
    (sweep / "1").mkdir()
    (sweep / "1" / "train.log").write_text("Traceback (most recent call last): ...\n")
    assert main([str(sweep / "*")]) == 0
    captured = capsys.readouterr()
    assert [row["run"] for row in table_rows(captured.out)] == ["0", "2"]
    assert captured.err.splitlines() == [f"warning: skipped {sweep / '1'}, matched by {str(sweep / '*')!r}: not a run "
                                         "directory (it has no config.yaml and no TensorBoard events)"]
    for bad in (str(sweep / "1"), str(sweep / "1*")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(sweep / "0"), bad])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert f"{sweep / '1'}" in lines[0] and "(RUN_DIR)" in lines[0]


def test_the_settings_that_differ_are_columns_and_legends(tmp_path, capsys, monkeypatch):
    """An lr sweep: an optim.lr column and `optim.lr=...` in the figures' legends instead of the folders' digests;
    run.* paths and logging cadence are left out, a layout's dp mode is shown (its axis sizes are the layout's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.compare.figures import plot_loss
    from utils.compare.report import label_runs, load_run

    a = fake_run(tmp_path / "vit_tiny-era5_synthetic-single-fp32", "optim.lr=5e-4", "trainer.log_every=5")
    b = fake_run(tmp_path / "vit_tiny-era5_synthetic-single-fp32-7691b9", "optim.lr=1e-3", f"run.root={tmp_path}")
    assert main([str(a), str(b)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [(row["run"], row["optim.lr"]) for row in rows] == [(a.name, "0.0005"), (b.name, "0.001")]
    assert list(rows[0])[:3] == ["run", "optim.lr", "layout"]  # nothing else differs that matters
    runs = [load_run(d, d.name) for d in (a, b)]
    label_runs(runs)
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    plot_loss(plt, runs, tmp_path / "loss.png", against_time=False)
    assert closed[0].axes[0].get_legend_handles_labels()[1] == ["optim.lr=0.0005 train", "optim.lr=0.001 train"]

    c = fake_run(tmp_path / "fsdp", "optim.lr=1e-3", "parallel.dp_mode=fsdp", "parallel.tp=2")
    runs = [load_run(d, d.name) for d in (b, c)]
    settings = label_runs(runs)
    assert settings.columns == ["parallel.dp_mode"] and [r.label for r in runs] == [
        "single, parallel.dp_mode=ddp", "tp2, parallel.dp_mode=fsdp"]


def test_presets_chosen_differently_are_one_column(tmp_path, capsys):
    """Another model and data: `model` and `data` columns (from presets.json) instead of some forty settings; runs
    without presets.json: the family keys first, at most 6 columns, the others named under the table."""
    vit = fake_run(tmp_path / "with" / "vit", "optim.lr=1e-3")
    gpt = fake_run(tmp_path / "with" / "gpt", "model=gpt_tiny", "data=wikitext_sample")
    assert main([str(vit), str(gpt)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert list(rows[0])[:5] == ["run", "model", "data", "optim.lr", "layout"]
    assert [(row["model"], row["data"]) for row in rows] == [("vit_tiny", "era5_synthetic"),
                                                             ("gpt_tiny", "wikitext_sample")]
    old = [fake_run(tmp_path / "old" / d.name, *args, presets=False)
           for d, args in ((vit, ["optim.lr=1e-3"]), (gpt, ["model=gpt_tiny", "data=wikitext_sample"]))]
    assert main([str(d) for d in old]) == 0
    out = capsys.readouterr().out
    assert list(table_rows(out)[0])[1:8] == ["data.kind", "model.arch", "task.kind", "optim.lr", "data.attention",
                                             "data.bpe_vocab_size", "layout"]
    assert "other settings that differ between the runs: data.channels, " in out


def test_a_setting_that_differs_within_one_preset_keeps_its_column(tmp_path, capsys):
    """Two Llama runs of two tokenizers beside a ViT run: the `model` and `data` columns, and data.tokenizer's, which
    tells the two Llama runs apart (the ViT run has none)."""
    runs = [fake_run(tmp_path / "vit", "optim.lr=1e-3"),
            *(fake_run(tmp_path / kind, "model=llama_tiny", "data=wikitext_sample", f"data.tokenizer={kind}")
              for kind in ("bpe", "word"))]
    assert main([str(d) for d in runs]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [row.get("data.tokenizer") for row in rows] == ["", "bpe", "word"]
    assert rows[0]["model"] == "vit_tiny" and rows[1]["model"] == rows[2]["model"] == "llama_tiny"
