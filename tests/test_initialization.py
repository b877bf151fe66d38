"""Initial weights computed shard by shard (networks/initialization.py, utils/engine/materialize.py).

- A piece of a tensor, drawn alone, equals the same slice of the whole tensor drawn at once, for every box
  (rows across several blocks, columns, 1-D and 3-D tensors) and every distribution; the vocabulary
  padding changes no real row; the distributions are the models' (std, truncation, the residual scaling).
- Built under a layout (tp, FSDP, pp, their products, grouped K/V replicated over tp, uneven FSDP chunks,
  a tied head held apart by the last pipeline stage, or shared), the model's checkpoint (written by DCP from each rank's
  pieces) holds exactly the weights of the one-process model built on the CPU, each rank's model shares
  parameters where the serial one does (a tied head stays one tensor), and no rank allocated a whole tensor
  it does not hold (its parameters' bytes are its share).
"""

from __future__ import annotations

import pytest
import torch

import networks.initialization as init_module
from networks.initialization import Init, block_rows, fill_
from tests.helpers import NARROW, TINY_GPT, run_ranks

SEED = 7


def whole(init: Init, shape: tuple[int, ...], key: str = "w") -> torch.Tensor:
    full = torch.empty(shape)
    fill_(full, init, seed=SEED, key=key, full_shape=shape, offsets=(0,) * len(shape))
    return full


@pytest.mark.parametrize("shape", [(37,), (50, 24), (3, 7, 5), (1, 30, 8)])
@pytest.mark.parametrize("init", [Init("normal", 0.5), Init("trunc_normal", 0.02), Init("ones"),
                                  Init("normal", 1.0, valid_rows=2)])
def test_a_piece_equals_the_slice_of_the_whole_tensor(shape, init, monkeypatch):
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 48)  # several blocks per tensor, a piece across them
    full = whole(init, shape)
    gen = torch.Generator().manual_seed(len(shape))
    for _ in range(12):
        starts = [int(torch.randint(0, n, (), generator=gen)) for n in shape]
        sizes = [int(torch.randint(1, n - s + 1, (), generator=gen)) for s, n in zip(starts, shape)]
        piece = torch.full(sizes, float("nan"))
        fill_(piece, init, seed=SEED, key="w", full_shape=shape, offsets=starts)
        box = tuple(slice(s, s + n) for s, n in zip(starts, sizes))
        torch.testing.assert_close(piece, full[box], rtol=0, atol=0)


def test_streams_depend_on_the_seed_and_the_name():
    a = whole(Init("normal", 1.0), (8, 8))
    assert torch.equal(a, whole(Init("normal", 1.0), (8, 8)))
    assert not torch.equal(a, whole(Init("normal", 1.0), (8, 8), key="v"))
    tied = whole(Init("normal", 1.0, key="w"), (8, 8), key="head")  # a tied head draws its embedding's stream
    assert torch.equal(a, tied)


def test_padding_changes_no_real_row():
    real = whole(Init("normal", 1.0, valid_rows=100), (100, 16))
    padded = whole(Init("normal", 1.0, valid_rows=100), (128, 16))
    assert torch.equal(padded[:100], real) and not padded[100:].any()
    assert block_rows((100, 16)) == block_rows((128, 16))


def test_the_distributions_are_the_models():
    w = whole(Init("trunc_normal", 0.02), (1024, 512))
    assert abs(w.std().item() - 0.02 * 0.880) < 5e-4  # a normal truncated at 2 std has 0.880 std
    assert w.abs().max().item() <= 0.04
    assert abs(whole(Init("normal", 0.5), (512, 512)).std().item() - 0.5) < 5e-3
    assert torch.equal(whole(Init("zeros"), (3, 4)), torch.zeros(3, 4))


# Layouts of a 4-rank job (tp, pp, dp, dp mode): each rank builds its pieces, DCP writes them.
LAYOUTS = {
    "tp2_fsdp2": ("parallel.tp=2", "parallel.dp_mode=fsdp"),
    "pp2_tp2": ("parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=gpipe"),
    "pp2_fsdp2": ("parallel.pp=2", "parallel.dp_mode=fsdp", "parallel.pp_schedule=gpipe"),
    "fsdp4": ("parallel.dp_mode=fsdp",),
    "tp4": ("parallel.tp=4",),
    # llama_tiny: 2 key/value heads, so the fused QKV is replicated over tp
    "tp2_dp2": ("parallel.tp=2",),  # DDP replicas
}
MODELS = {
    "gpt": [*TINY_GPT, *NARROW, "model.depth=2"],  # tied head: the last stage draws the embedding's stream
    "llama": ["model=llama_tiny", *TINY_GPT[1:], *NARROW, "model.depth=2", "model.vocab_multiple=48"],
    "vit": [*NARROW, "model.depth=2"],  # 1-row position table: empty FSDP chunks on three of four ranks
}
CASES = [("gpt", "tp2_fsdp2"), ("gpt", "tp2_dp2"), ("gpt", "pp2_tp2"), ("gpt", "pp2_fsdp2"),
         ("llama", "tp4"), ("llama", "pp2_fsdp2"), ("vit", "fsdp4"), ("vit", "pp2_tp2")]


def _build_and_save(rank: int, world_size: int, argv: list[str], folder: str) -> None:
    """This rank's build, written as a checkpoint; it holds a share of the model's parameters."""
    from pathlib import Path

    from distributed.placement import local_pieces, parameter_names
    from utils.checkpoints.sharded_state import checkpoint_view, save_state
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.engine.build import build_model
    from utils.tasks import build_task

    cfg, _, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    task = build_task(cfg)
    model = build_model(cfg, task, grid).raw
    save_state(checkpoint_view(model, None, grid, for_load=False).tensors, Path(folder), grid.world)
    with torch.device("meta"):
        serial = task.build_model()
    held = set(parameter_names(model))  # the serial model's ties among the names this rank holds, no other
    assert ties(model) == {names & held for names in ties(serial) if len(names & held) > 1}, ties(model)
    # Each rank holds a share (4 ranks: at most 0.6 of the whole), of the blocks under every layout; under pp x
    # FSDP the stages' ends (embeddings, head) stay replicated over dp (distributed/fsdp.py)
    ends_replicated = cfg.parallel.pp > 1 and cfg.parallel.dp_mode == "fsdp"
    for part in ("blocks.",) if ends_replicated else ("blocks.", ""):
        total = sum(p.numel() for name, p in serial.named_parameters() if name.startswith(part))
        held = sum(p.local.numel() for p in local_pieces(model) if p.name.startswith(part))
        assert held <= 0.6 * total, f"rank {rank} holds {held} of the model's {total} parameters ({part!r})"


def ties(model: torch.nn.Module) -> set[frozenset[str]]:
    """The names that share one parameter (a tied head and embedding), as groups of two or more."""
    from distributed.placement import parameter_names

    groups: dict[int, set[str]] = {}
    for name, param in parameter_names(model).items():
        groups.setdefault(id(param), set()).add(name)
    return {frozenset(names) for names in groups.values() if len(names) > 1}


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_every_layout_builds_the_one_process_weights(model, layout, tmp_path, era5_root, corpus_root):
    from utils.checkpoints.sharded_state import read_full
    from utils.cli.config import load_config
    from utils.tasks import build_task

    root = era5_root if model == "vit" else corpus_root
    argv = [*MODELS[model], f"data.root={root}", "trainer.seed=11", f"run.dir={tmp_path}/run"]
    run_ranks(_build_and_save, 4, tmp_path, [*argv, *LAYOUTS[layout]], str(tmp_path / "ckpt"))
    cfg, _, _ = load_config(argv)
    torch.manual_seed(cfg.trainer.seed)  # a CPU build initialises from the default generator's seed
    serial = build_task(cfg).build_model().state_dict()
    saved = {k.removeprefix("model/"): v for k, v in read_full(tmp_path / "ckpt").items()}
    assert saved.keys() == serial.keys()
    for name, tensor in serial.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
