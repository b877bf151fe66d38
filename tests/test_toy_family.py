"""A model family from its own folder: tests/toy_family declares a decoder of parallel blocks and its preset
(the family-module contract of utils/tasks/registry.py), the registry adds it (`add_modules`, what
DLSCALE_FAMILIES does), and it trains under tp2, cp2 (ring and all-to-all), pp2 and FSDP like the built-in
families: every layout follows its one-process curve (fp32, relative 1e-4), with no edit outside that folder.
tests/test_family_discovery.py finds it through DLSCALE_FAMILIES and an entry point. Its Hugging Face adapter
is in that folder too (tests/toy_family/hf.py): export, whole import, import by slices and the import-hf command
work through its spec, with no edit elsewhere.

The registry's contract is also refused where a family breaks it: an attention core that is not plain
softmax attention under cp (it would be replaced, not split), and a task loss the pipeline would not compute.
"""

from __future__ import annotations

import pytest

from tests.helpers import QUIET, read_scalars, run_main

STEPS = 4
TOY = ["model=toy_tiny", "data=wikitext_sample", "data.seq_len=32", "data.sample_tokens=0", "optim.lr=2e-3",
       "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.log_every=1", *QUIET]
LAYOUTS = {"tp2": ["parallel.tp=2"], "cp2": ["parallel.cp=2"], "cp2_alltoall": ["parallel.cp=2",
           "parallel.cp_attention=alltoall"], "pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
           "tp2_fsdp2": ["parallel.tp=2", "parallel.dp_mode=fsdp"]}


def with_toy() -> None:
    """The tests-only family added in this process, as DLSCALE_FAMILIES=tests.toy_family adds it."""
    from utils.tasks.registry import add_modules

    add_modules(["tests.toy_family"])


def test_the_toy_family_exchanges_weights_through_its_own_adapter(tmp_path):
    """A random toy model written as a folder of its layout, read back whole (exactly, the vocabulary padded with
    zeros), every box read by slices equal to the whole import, and import-hf's settings naming its preset."""
    import torch

    from distributed.placement import Piece
    from tests.toy_family.model import ToyConfig, ToyLM
    from utils.checkpoints import hf
    from utils.checkpoints.hf_stream import read_pieces, write_folder
    from utils.export.convert import import_hf

    with_toy()
    cfg, vocab = ToyConfig(embed_dim=32, depth=2, num_heads=4, mlp_hidden=48, max_positions=16), 50  # 64 rows
    torch.manual_seed(0)
    state = ToyLM(cfg, vocab).state_dict()
    folder = tmp_path / "toy_hf"
    write_folder(folder, hf.hf_config(cfg, vocab), hf.from_project(cfg, state, vocab), None)
    assert hf.model_settings(hf.read_config(folder))[0] == "toy"  # found through the family's spec
    back = hf.import_state(folder, cfg, vocab)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert state["tok_embed.weight"].shape[0] == 64 and not back["tok_embed.weight"][vocab:].any()
    gen, pieces = torch.Generator().manual_seed(1), []
    for name, tensor in back.items():
        for _ in range(4):
            box = [slice(s := int(torch.randint(0, n, (), generator=gen)), s + 1 + int(torch.randint(0, n - s, (),
                   generator=gen))) for n in tensor.shape]
            pieces.append(Piece(name, torch.full([b.stop - b.start for b in box], float("nan")), tuple(tensor.shape),
                                tuple(b.start for b in box)))
    read_pieces(folder, cfg, vocab, pieces)
    for piece in pieces:
        assert torch.equal(piece.local, back[piece.name][piece.slices()]), (piece.name, piece.slices())
    _, settings = import_hf(folder, tmp_path / "imported")
    assert settings[0] == "model=toy_tiny" and "model.embed_dim=32" in settings and "model.mlp_hidden=48" in settings
    code, _, err = run_main("utils.generate.command", str(folder), "--prompt", "a b")  # it declares no decoding
    assert code == 2 and "the toy decoder model does not decode token by token" in err and err.count("\n") == 1


def _entry_with_toy(rank: int, world: int, argv: list[str]) -> int:
    """train.py on a pooled rank, with the tests-only family added (DLSCALE_FAMILIES would, in a fresh process)."""
    from tests.rank_pool import _entry

    with_toy()

    return _entry(rank, world, argv)


def run_toy(run_dir, corpus_root, layout: list[str], world: int) -> list[float]:
    from tests.rank_pool import pool

    argv = [*TOY, f"data.root={corpus_root}", f"run.dir={run_dir}", *layout]
    results = pool().run(_entry_with_toy, world, argv, timeout_s=180)
    assert [r.value for r in results] == [0] * world, results[0].stderr[-3000:]
    return [v for _, v in read_scalars(run_dir)["train/loss"]]


@pytest.fixture(scope="module")
def toy_reference(tmp_path_factory, corpus_root):
    return run_toy(tmp_path_factory.mktemp("toy") / "single", corpus_root, [], 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_toy_family_trains_under_every_axis(layout, toy_reference, corpus_root, tmp_path):
    world = 4 if layout == "tp2_fsdp2" else 2
    got = run_toy(tmp_path / layout, corpus_root, LAYOUTS[layout], world)
    assert len(got) == STEPS and got == pytest.approx(toy_reference, rel=1e-4)
    assert toy_reference[-1] < toy_reference[0]  # it trains


def test_a_family_built_on_meta_keeps_the_contract(corpus_root):
    import torch

    from networks.spec import check_family_model
    from utils.cli.config import load_config
    from utils.tasks import build_task

    with_toy()
    cfg, _, _ = load_config([*TOY, f"data.root={corpus_root}"])
    with torch.device("meta"):
        assert check_family_model(build_task(cfg).build_model()) == []


def _sliding_core_under_cp(rank: int, world: int, argv: list[str]) -> None:
    import torch

    from distributed.context.parallelize import parallelize_context
    from networks.blocks import ScaledDotProductAttention
    from utils import ConfigError
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.tasks import build_task

    class SlidingWindow(ScaledDotProductAttention):  # another core (a subclass): not one cp knows how to split
        pass

    with_toy()
    cfg, _, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    with torch.device("meta"):
        model = build_task(cfg).build_model()
    for block in model.blocks:
        block.attn.attend = SlidingWindow(causal=True, dropout=0.0)
    with pytest.raises(ConfigError, match=r"blocks\.0\.attn\.attend is a SlidingWindow, not the plain softmax"):
        parallelize_context(model, grid=grid, variant=cfg.parallel.cp_attention)


def test_cp_refuses_an_attention_core_it_would_replace(corpus_root, tmp_path):
    from tests.helpers import run_ranks

    run_ranks(_sliding_core_under_cp, 2, tmp_path, [*TOY, f"data.root={corpus_root}", "parallel.cp=2"])


def test_pp_refuses_a_loss_its_last_stage_would_not_compute(corpus_root, monkeypatch):
    """A task whose training loss is not criterion(model(x), y) (an auxiliary term, several calls): pp exits 2."""
    from utils import ConfigError
    from utils.cli.config import load_config
    from utils.language.task.language import LanguageTask

    with_toy()
    monkeypatch.setattr(LanguageTask, "loss_is_criterion", staticmethod(lambda cfg: False))
    with pytest.raises(ConfigError, match=r"toy decoder task's training loss .* not criterion\(model\(x\), y\)"):
        load_config([*TOY, f"data.root={corpus_root}", "parallel.pp=2"])
    load_config([*TOY, f"data.root={corpus_root}"])  # pp=1 runs the task's own training_loss
