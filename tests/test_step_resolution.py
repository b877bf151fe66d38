"""What the tools take for a checkpoint (utils/checkpoints/run_dir.py `resolve_step`): a run directory, its
checkpoints/ folder or checkpoints/latest stand for the complete step folder they name, a missing or incomplete
step is refused in one line that lists the complete steps there are.

- resolve_step on hand-made step folders (a COMPLETE marker naming no file makes a step complete).
- Each tool given a run directory of a tiny GPT run (two checkpoints) reads its newest step and says so on
  stderr, with the result it gives for that step folder: `utils.generate` (and its warning for prompt words
  outside the vocabulary), `utils.evaluate`, `utils.export export` and `export-hf`, and `trainer.init_from`.
- `utils.forecast` given a ViT run's directory, and its summary: units, persistence beside the model, what good
  values are; metrics.md and ensemble.md with a units column; a rollout too long names --steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.helpers import QUIET, TINY_GPT, run_main
from utils import ConfigError
from utils.checkpoints.run_dir import resolve_step
from utils.cli.config import load_config


def fake_step(run: Path, step: int, complete: bool = True) -> Path:
    folder = run / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "COMPLETE").write_text(json.dumps({"step": step, "files": []}))
    return folder


def refusal(path: Path, setting: str = "CHECKPOINT") -> str:
    with pytest.raises(ConfigError) as err:
        resolve_step(path, setting)
    return err.value.line()


def test_resolve_step_takes_what_a_user_has_in_hand(tmp_path):
    run = tmp_path / "run"
    one, two = fake_step(run, 1), fake_step(run, 2)
    fake_step(run, 3, complete=False)  # a save that died: never taken
    (run / "checkpoints" / "latest").write_text("step_0000001\n")
    assert resolve_step(run, "X") == two and resolve_step(run / "checkpoints", "X") == two
    assert resolve_step(run / "checkpoints" / "latest", "X") == one  # the step it names, not the newest
    assert resolve_step(one, "X") == one
    for missing in (run / "checkpoints" / "step_0000009", run / "checkpoints" / "step_0000003"):
        line = refusal(missing)
        assert line.startswith(f"error: {missing} ") and line.count("\n") == 0
        assert line.endswith(f"(CHECKPOINT): pick one of the complete steps in {run / 'checkpoints'}: "
                             "step_0000001, step_0000002")
    assert "is not a complete checkpoint" in refusal(run / "checkpoints" / "step_0000003")
    assert "does not exist" in refusal(run / "checkpoints" / "step_0000009")
    empty = tmp_path / "empty"
    fake_step(empty, 1, complete=False)
    assert refusal(empty, "trainer.init_from") == (f"error: {empty} holds no complete checkpoint (trainer.init_from): "
                                                  "train the run until it saves one (trainer.ckpt_every), or give a "
                                                  "step_* folder")


# ------------------------------------------------------------------------------------------- the language tools
@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_root):
    """A tiny GPT run of 2 steps with a checkpoint after each: (run directory, the trainer)."""
    from utils.cli.runs import run_digest
    from utils.engine.build import build_run

    run = tmp_path_factory.mktemp("resolution") / "run"
    cfg, choices, yaml = load_config([f"run.dir={run}", *QUIET, *TINY_GPT, f"data.root={corpus_root}",
                                      "model.depth=2", "trainer.max_steps=2", "trainer.global_batch_size=4"])
    trainer = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))
    batches = iter(trainer.loaders.train)
    for _ in range(2):
        trainer.train_step(*next(batches))
        trainer.step += 1
        trainer.save_checkpoint()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]
    return run, trainer


def reads_newest(err: str, run: Path, given: Path) -> None:
    assert f"reading {run / 'checkpoints' / 'step_0000002'} (from {given})\n" in err, err


def test_generate_reads_a_run_directory_and_warns_of_unknown_words(gpt_run):
    run, _ = gpt_run
    prompt = ["--prompt", "the Quantumqq of xylophoneqq", "--temperature", "0", "--max-new-tokens", "4"]
    code, out, err = run_main("utils.generate.command", str(run), *prompt)
    assert code == 0, err
    reads_newest(err, run, run)
    assert ('warning: the prompt\'s words "Quantumqq", "xylophoneqq" are not in the tokenizer\'s vocabulary; they '
            "read as <unk>\n") in err
    step = run / "checkpoints" / "step_0000002"
    same = run_main("utils.generate.command", str(step), *prompt)
    assert same[:2] == (0, out) and "reading" not in same[2]
    assert "warning" not in run_main("utils.generate.command", str(step), "--prompt", "the",
                                     "--max-new-tokens", "1")[2]
    code, _, err = run_main("utils.generate.command", str(run / "checkpoints" / "step_0000009"), *prompt)
    assert code == 2 and err.count("\n") == 1 and err.endswith(
        f"(CHECKPOINT_OR_HF_FOLDER): pick one of the complete steps in {run / 'checkpoints'}: step_0000001, "
        "step_0000002\n"), err


def test_unknown_words_of_each_kind_of_tokenizer(corpus_root, tmp_path):
    from tests.helpers import make_tokenizer
    from utils.generate.command import unknown_warning, unknown_words
    from utils.language.data.tokenizers import PretrainedTokenizer, WordTokenizer

    words = WordTokenizer.train(["the cat sat"])
    assert unknown_words(words, ["the dog sat", "a cat dog"]) == ["dog", "a"]
    assert unknown_warning(words, ["the dog"]) == ('warning: the prompt\'s word "dog" is not in the tokenizer\'s '
                                                   "vocabulary; it reads as <unk>")
    assert unknown_warning(words, ["the cat"]) is None
    level = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "the": 2}, unk_token="[UNK]"))
    level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    level.save(str(tmp_path / "tokenizer.json"))
    assert unknown_warning(PretrainedTokenizer.load(str(tmp_path)), ["the owl"]).endswith("it reads as [UNK]")
    byte_level = PretrainedTokenizer.load(str(make_tokenizer(tmp_path / "bpe", corpus_root, ["<|endoftext|>"])))
    assert unknown_words(byte_level, ["Quantumqq xylophoneqq"]) == []  # every byte has a token


def test_evaluate_reads_a_run_directory(gpt_run, tmp_path):
    run, _ = gpt_run
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"context": "the", "choices": [" of", " the", " and"], "answer": i % 3}) + "\n"
                             for i in range(3)))
    code, out, err = run_main("utils.evaluate.command", str(run / "checkpoints"), "--task", str(items))
    assert code == 0 and out.startswith("accuracy "), err
    reads_newest(err, run, run / "checkpoints")
    assert run_main("utils.evaluate.command", str(run / "checkpoints" / "step_0000002"), "--task", str(items))[1] == out


def test_export_reads_a_run_directory_and_latest(gpt_run, tmp_path):
    run, trainer = gpt_run
    code, _, err = run_main("utils.export.convert", "export", str(run), str(tmp_path / "model.pt"))
    assert code == 0, err
    reads_newest(err, run, run)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["trainer"]["step"] == 2
    assert all(torch.equal(t, trainer.raw_model.state_dict()[k]) for k, t in state["model"].items())
    latest = run / "checkpoints" / "latest"
    code, _, err = run_main("utils.export.convert", "export-hf", str(latest), str(tmp_path / "hf"))
    assert code == 0 and (tmp_path / "hf" / "config.json").is_file(), err
    reads_newest(err, run, latest)
    code, _, err = run_main("utils.export.convert", "export", str(run / "checkpoints" / "step_0000007"),
                            str(tmp_path / "x.pt"))
    assert code == 2 and err.count("\n") == 1 and "step_0000001, step_0000002" in err


def test_init_from_takes_a_run_directory(gpt_run, tmp_path, corpus_root):
    """trainer.init_from=<run directory>: the new run starts from the weights of its newest step and logs it."""
    from utils.cli.runs import run_digest
    from utils.engine.build import build_run

    run, trainer = gpt_run
    new = tmp_path / "ft"
    cfg, choices, yaml = load_config([f"run.dir={new}", *QUIET, *TINY_GPT, f"data.root={corpus_root}",
                                      "model.depth=2", "trainer.global_batch_size=4", f"trainer.init_from={run}"])
    tuned = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))
    assert tuned.step == 0
    for a, b in zip(tuned.raw_model.parameters(), trainer.raw_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (f"model weights from {run / 'checkpoints' / 'step_0000002'} (trainer.init_from={run})"
            in (new / "train.log").read_text())
    missing = run / "checkpoints" / "step_0000005"
    code, _, err = run_main("train.py", *TINY_GPT, f"data.root={corpus_root}", f"run.dir={tmp_path / 'b'}",
                            f"trainer.init_from={missing}")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {missing} does not exist (trainer.init_from): pick one of the complete steps in "
        f"{run / 'checkpoints'}: step_0000001, step_0000002"]


# ------------------------------------------------------------------------------------------------ the forecast
@pytest.fixture(scope="module")
def vit_run(tmp_path_factory, era5_root):
    """A tiny ViT run of one step on the synthetic ERA5 copy, its checkpoint saved."""
    from utils.cli.runs import run_digest
    from utils.engine.build import build_run

    run = tmp_path_factory.mktemp("resolution") / "vit"
    cfg, choices, yaml = load_config([f"run.dir={run}", *QUIET, f"data.root={era5_root}", "trainer.max_steps=1",
                                      "trainer.global_batch_size=4", "data.limit_nsamples_val=4"])
    trainer = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))
    trainer.train_step(*next(iter(trainer.loaders.train)))
    trainer.step += 1
    trainer.save_checkpoint()
    return run


def test_forecast_reads_a_run_directory_and_its_summary_says_what_the_numbers_mean(vit_run, era5_root, tmp_path,
                                                                                   capsys):
    """The summary: per channel its units, the RMSE at the first and last lead beside persistence's (metrics.csv's
    numbers), the blurring and ensemble figures, and one line on what good values are; the tables' units."""
    import csv

    from utils.forecast.report import main

    out = tmp_path / "out"
    assert main([str(vit_run), "--steps", "2", "--init", "2", "--members", "2", "--map-leads", "--out", str(out),
                 f"data.root={era5_root}"]) == 0
    printed, err = capsys.readouterr()
    assert f"reading {vit_run / 'checkpoints' / 'step_0000001'} (from {vit_run})\n" in err
    rmse = {(r["channel"], r["lead_h"], r["forecast"]): float(r["rmse"])
            for r in csv.DictReader((out / "metrics.csv").open())}
    lines = printed.splitlines()
    assert lines[0].startswith("wrote ") and len(lines) == 5, printed
    units = {"u10m": "m/s", "t2m": "K", "z500": "m^2/s^2"}  # the NERSC channel table (utils/weather/data/era5.py)
    for line, channel in zip(lines[1:4], units, strict=True):
        at = {h: tuple(f"{rmse[(channel, h, name)]:.4g}" for name in ("model", "persistence")) for h in ("6", "12")}
        assert line.startswith(f"{channel} ({units[channel]}): RMSE {at['6'][0]} at 6 h (persistence {at['6'][1]}), "
                               f"{at['12'][0]} at 12 h (persistence {at['12'][1]}); blurring "), line
        assert "; 2 members: CRPS " in line and "spread/skill " in line
    assert lines[4].startswith("good: an RMSE below persistence's; blurring") and "near 1, below 1 smoothed" in lines[4]
    assert "spread/skill near 1 well dispersed, below 1 under-dispersive" in lines[4]
    metrics = (out / "metrics.md").read_text().splitlines()
    assert metrics[0].startswith("| channel | units | lead (h) | forecast | RMSE |")
    assert metrics[2].startswith("| u10m | m/s | 6 | model | ")
    ensemble = (out / "ensemble.md").read_text().splitlines()
    assert ensemble[0].startswith("| channel | units | lead (h) | CRPS |")
    assert ensemble[2].startswith("| u10m | m/s | 6 |")


def test_a_forecast_longer_than_the_data_names_steps(vit_run, era5_root, tmp_path, capsys):
    from utils.forecast.report import main

    with pytest.raises(SystemExit) as exit_:
        main([str(vit_run / "checkpoints" / "step_0000001"), "--steps", "40", "--out", str(tmp_path),
              f"data.root={era5_root}"])
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: a rollout of 40 steps of dt=1 needs 40 times after each of 8 initial times, and the validation split "
        "holds 0 such starts (segments of at most 32 times) (--steps): use --steps <= 24 or fewer --init"]
