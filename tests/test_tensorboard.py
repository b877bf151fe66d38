"""What a user sees in TensorBoard: loss curves on the first screen, the config as text and HParams, a
validation at step 0, the titled u10m figure, the LM's continuations next to the true text, why perf/mfu
is absent. Read back from the event files of real (in-process) runs."""

from __future__ import annotations

import glob

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from tests.test_precision import make_trainer
from utils.engine.logger import FIRST_SCREEN
from utils.weather.task.figures import field_panels

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

STEPS = 4
SHORT = [f"trainer.max_steps={STEPS}", "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.global_batch_size=8"]


def events(run_dir) -> EventAccumulator:
    return EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0}).Reload()


def texts(acc: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def hparams_summaries(run_dir) -> dict[str, list]:
    """The HParams plugin's summaries of a run by tag (_hparams_/experiment, ..._session_start_info, ...)."""
    found: dict[str, list] = {}
    for path in glob.glob(str(run_dir / "events.out.tfevents.*")):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    found.setdefault(value.tag, []).append(data)
    return found


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory, era5_root):
    run_dir = tmp_path_factory.mktemp("tb") / "vit"
    trainer = make_trainer(run_dir, f"data.root={era5_root}", "data.limit_nsamples_val=8", "optim.lr=2e-3", *SHORT)
    assert trainer.fit() == 0
    return run_dir


def test_first_screen_opens_on_the_loss_curves(vit_run):
    acc = events(vit_run)
    scalars = acc.Tags()["scalars"]
    # TensorBoard's Time Series tab expands the first two groups in its order (characters compared, capitals
    # first; no digits in these names, so Python's sort agrees): they must be the loss and the throughput
    groups = sorted({tag.split("/")[0] for tag in scalars + acc.Tags()["images"]})
    assert groups[:2] == ["Loss", "Throughput"] and {"data", "mem", "perf", "train", "val"} <= set(groups[2:])
    for tag, copy in FIRST_SCREEN.items():
        if tag in scalars:  # perf/mfu only on GPUs with a known peak
            assert [(e.step, e.value) for e in acc.Scalars(copy)] == [(e.step, e.value) for e in acc.Scalars(tag)]
    assert [e.step for e in acc.Scalars("Loss/train")] == list(range(1, STEPS + 1))
    layout = acc.Tags()["tensors"]
    assert "custom_scalars__config__" in layout  # the Custom Scalars tab: train vs val loss on one chart


def test_validation_at_step_0_and_at_the_end(vit_run):
    acc = events(vit_run)
    for tag in ("val/loss", "val/rmse/u10m", "Loss/val"):
        assert [e.step for e in acc.Scalars(tag)] == [0, STEPS], tag
    first, last = (e.value for e in acc.Scalars("val/loss"))
    assert last < first  # the untrained model's point is the start of the curve
    assert [e.step for e in acc.Images("val/u10m_pred_vs_target")] == [0, STEPS]


def test_no_figures_with_log_images_false(tmp_path, era5_root):
    """trainer.log_images=false: the same validations, no image (no matplotlib figure drawn)."""
    trainer = make_trainer(tmp_path / "quiet", f"data.root={era5_root}", "data.limit_nsamples_val=2", *SHORT,
                           "trainer.max_steps=1", "trainer.log_images=false")
    assert trainer.fit() == 0
    acc = events(tmp_path / "quiet")
    assert [e.step for e in acc.Scalars("val/loss")] == [0, 1] and acc.Tags()["images"] == []


def test_config_as_text_and_hparams(vit_run):
    acc = events(vit_run)
    [(step, config)] = texts(acc, "config")
    assert step == 0 and "    optim:" in config and "lr: 0.002" in config  # indented: a markdown code block
    assert config.replace("\n    ", "\n").strip() == (vit_run / "config.yaml").read_text().strip()
    summaries = hparams_summaries(vit_run)
    [start] = summaries["_hparams_/session_start_info"]
    settings = start.session_start_info.hparams
    assert settings["optim.lr"].number_value == pytest.approx(2e-3)
    assert settings["trainer.max_steps"].number_value == STEPS
    assert settings["parallel.sp_keep_gathered"].string_value == "false"  # a bool as text (sequence_parallel: unset)
    assert settings["data.img_size"].string_value == "[32, 64]"
    [experiment] = summaries["_hparams_/experiment"]
    metrics = [m.name.tag for m in experiment.experiment.metric_infos]
    assert metrics == ["train/loss", "val/loss", "val/rmse/u10m", "perf/samples_per_sec", "perf/tokens_per_sec"]
    assert len(summaries["_hparams_/session_end_info"]) == 1  # written when the run reached max_steps


def test_absent_mfu_is_explained(vit_run):
    acc = events(vit_run)
    assert "perf/mfu" not in acc.Tags()["scalars"]  # the CPU has no peak
    [(_, note)] = texts(acc, "notes")
    assert note.startswith("perf/mfu is not logged") and "the CPU" in note and len(note) < 120  # short
    assert (vit_run / "train.log").read_text().count(note) == 1  # once, at the run's start


def test_u10m_figure_has_titled_panels_on_one_colour_scale():
    pred, target = torch.tensor([[0.5, -1.0], [2.0, 0.0]]), torch.tensor([[0.0, 1.5], [-3.0, 0.0]])
    fig = field_panels(pred, target, "u10m", 7)
    axes = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in axes] == ["prediction", "target", "error (prediction - target)"]
    vmax = 5.0  # |error| at [1, 0]: 2 - (-3)
    assert all(ax.images[0].get_clim() == (-vmax, vmax) for ax in axes)
    assert torch.equal(torch.as_tensor(axes[2].images[0].get_array()), pred - target)
    colorbar = [ax for ax in fig.axes if not ax.images]
    assert len(colorbar) == 1 and "[-5, 5]" in colorbar[0].get_xlabel()
    assert "step 7" in fig.get_suptitle()


def test_lm_continuations_stand_next_to_the_true_text(tmp_path, corpus_root):
    run_dir = tmp_path / "lm"
    trainer = make_trainer(run_dir, "model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}",
                           "data.seq_len=32", "trainer.max_steps=2", "trainer.val_every=0", "trainer.ckpt_every=0",
                           "trainer.global_batch_size=8")
    assert trainer.fit() == 0
    task = trainer.task
    decode, valid, n = task.corpus.tokenizer.decode, task.corpus.valid, task.prompt_len
    [(step0, table0), (step2, table)] = texts(events(run_dir), "val/samples")
    assert (step0, step2) == (0, 2)
    header, rule, *rows = table.split("\n")
    assert header == "| prompt | model (greedy) | true text |" and rule == "|---|---|---|"
    assert len(rows) == task.num_prompts
    for row, start in zip(rows, task.prompt_starts()):
        prompt, model, true = (cell.strip() for cell in row.strip("|").split(" | "))
        assert prompt == " ".join(decode(valid[start:start + n].tolist()).split())
        assert true == " ".join(decode(valid[start + n:start + n + task.new_tokens].tolist()).split())
        assert model
