"""Export (a checkpoint -> one torch.save file of the single-process state) and import (back), in-process."""

import pytest
import torch

from utils.checkpoints.sharded_state import read_full
from utils.cli.config import load_config
from utils.cli.runs import run_digest
from utils.engine.build import build_run
from utils.export.convert import main


def make_trainer(run_dir, *overrides):
    cfg, choices, yaml = load_config([f"run.dir={run_dir}", "trainer.num_workers=0", "trainer.max_steps=10",
                                      *overrides])
    return build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))


@pytest.fixture
def gpt(corpus_root):
    return ["model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}", "data.seq_len=32",
            "trainer.global_batch_size=4"]


def reads_one_at_a_time(monkeypatch) -> list[int]:
    """Make the export's checkpoint reads count, as each tensor arrives, how many earlier ones are still alive."""
    import weakref

    import utils.export.convert as convert

    alive_before, refs, read = [], [], convert.iter_full

    def counted(folder, prefix=""):
        for key, tensor in read(folder, prefix):
            alive_before.append(sum(ref() is not None for ref in refs))
            refs.append(weakref.ref(tensor))
            yield key, tensor
            del tensor

    monkeypatch.setattr(convert, "iter_full", counted)
    return alive_before


def test_export_loads_into_a_plain_model_and_imports_back(tmp_path, gpt, monkeypatch):
    """The file holds the single-process state: a plain model loads it (strict) and computes what the trainer
    computes, and import gives back every checkpoint tensor. Written one tensor at a time: when the export
    reads a tensor from the checkpoint, none it read before is alive."""
    trainer = make_trainer(tmp_path / "run", *gpt)
    alive_before = reads_one_at_a_time(monkeypatch)
    batches = iter(trainer.loaders.train)
    for _ in range(2):
        trainer.train_step(*next(batches))
        trainer.step += 1
    saved = trainer.save_checkpoint()
    file = tmp_path / "model.pt"
    assert main(["export", str(saved), str(file)]) == 0
    assert len(alive_before) == len([k for k in read_full(saved) if not k.startswith("rng/")])
    assert set(alive_before) == {0}

    state = torch.load(file, weights_only=True)
    assert state["trainer"]["step"] == 2 and state["trainer"]["samples"] == 8
    plain = trainer.task.build_model()  # a fresh single-process model: other weights until loaded
    plain.load_state_dict(state["model"])  # strict: every name, every shape
    assert plain.lm_head.weight is plain.tok_embed.weight  # still tied
    x, _ = next(batches)
    trainer.raw_model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), trainer.raw_model(x))
    assert torch.equal(state["optimizer"]["blocks.0.mlp.fc1.weight"]["exp_avg"],
                       trainer.optimizer.state[trainer.raw_model.blocks[0].mlp.fc1.weight]["exp_avg"])

    assert main(["import", str(file), str(tmp_path / "imported")]) == 0
    original, imported = read_full(saved), read_full(tmp_path / "imported" / "checkpoints" / "step_0000002")
    assert imported.keys() == {k for k in original if not k.startswith("rng/")}
    assert all(torch.equal(imported[k], original[k]) for k in imported)

    resumed = make_trainer(tmp_path / "imported", *gpt)  # trainer.resume=auto finds the imported step
    assert resumed.step == 2 and resumed.current_lr() == trainer.current_lr()
    for a, b in zip(resumed.raw_model.parameters(), trainer.raw_model.parameters()):
        assert torch.equal(a, b)


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path), str(tmp_path / "x.pt")])
    assert info.value.code == 2 and "holds no complete checkpoint" in capsys.readouterr().err
    torch.save({"weight": torch.zeros(2)}, tmp_path / "bare.pt")
    with pytest.raises(SystemExit):
        main(["import", str(tmp_path / "bare.pt"), str(tmp_path / "run")])
    assert "not a file written by `python -m utils.export export`" in capsys.readouterr().err
