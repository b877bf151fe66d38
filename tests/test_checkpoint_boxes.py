"""Checkpoints written and read as boxes (utils/checkpoints/sharded_state.py `Box`), with no collective and no
full-size buffer, under even and uneven tensor-parallel splits with FSDP on top.

- Saved under tp x FSDP (tp2 x dp2; tp3 x dp2, where the padded vocabulary's 1472 rows split 491/491/490 and
  FSDP chunks each of those 246/245, 246/245, 245/245) and under FSDP alone, a save moves no byte over the
  grid's axes (every collective of this project is counted there; DCP's own coordination, the exchange of
  plans and metadata on the world group, is outside that count) and the view holds only tensors that share
  storage with the live parameters, moments and buffers. The checkpoint equals the one-process model and
  the full moments each rank filled its box of.
- A background save stages only this rank's share: over the ranks, every element once; same checkpoint.
- Loaded under another layout (FSDP, pp x tp, uneven tp), with no byte over the grid, every parameter and
  Adam moment a rank holds is its box of the saved tensor, and that layout writes the same checkpoint back.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers import NARROW, TINY_GPT, run_ranks

MODELS = {
    "even": [*TINY_GPT, *NARROW, "model.depth=2"],
    "uneven": [*TINY_GPT, "model.embed_dim=96", "model.num_heads=6", "model.depth=2"],  # 6 heads for tp3
}
LAYOUTS = {  # name: (ranks, settings)
    "tp2_fsdp2": (4, ("parallel.tp=2", "parallel.dp_mode=fsdp")),
    "tp3_fsdp2": (6, ("parallel.tp=3", "parallel.dp_mode=fsdp")),
    "fsdp4": (4, ("parallel.dp_mode=fsdp",)),
    "pp2_tp2": (4, ("parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=gpipe")),
    "tp3": (3, ("parallel.tp=3",)),
}
CASES = [("even", "tp2_fsdp2", "fsdp4"), ("even", "fsdp4", "pp2_tp2"), ("uneven", "tp3_fsdp2", "pp2_tp2"),
         ("uneven", "tp2_fsdp2", "tp3")]
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP = 7.0


def moment(name: str, entry: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full Adam moment the test gives parameter `name` (its first name, as one process has it)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{entry}".encode()))
    return torch.randn(shape, generator=gen)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _build(argv: list[str]):
    """This rank's grid, model shards and AdamW (no state yet)."""
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.engine.build import build_model
    from utils.tasks import build_task

    cfg, _, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    model = build_model(cfg, build_task(cfg), grid).raw
    return grid, model, torch.optim.AdamW(model.parameters())


def _save(rank: int, world_size: int, argv: list[str], folder: str) -> None:
    """Fill this rank's boxes of the moments, then save: synchronously (no grid bytes, no new tensor) and in
    the background (this rank's share written to share_<rank>.json for the parent to add up)."""
    from distributed.placement import local_pieces
    from utils.checkpoints.sharded_state import (
        Box,
        checkpoint_view,
        own_share,
        save_state,
    )
    from utils.comm import background_group

    grid, model, optimizer = _build(argv)
    view = checkpoint_view(model, optimizer, grid, for_load=False)  # zero moments, step 0
    for piece in local_pieces(model):
        state = optimizer.state[piece.param]
        for entry in MOMENTS:
            _local(state[entry]).copy_(moment(piece.name, entry, piece.full_shape)[piece.slices()])
        state["step"].fill_(STEP)
    live = [p.local for p in local_pieces(model)] + list(model.buffers())
    live += [_local(v) for state in optimizer.state.values() for v in state.values()]
    storages = {t.untyped_storage().data_ptr() for t in live}
    held = [t.local if isinstance(t, Box) else t for t in view.tensors.values()]
    assert all(t.untyped_storage().data_ptr() in storages for t in held), "the view allocated a tensor"
    assert any(isinstance(t, Box) for t in view.tensors.values())
    grid.reset_comm_bytes()
    save_state(view.tensors, Path(folder) / "sync", grid.world)
    assert not any(grid.comm_bytes().values()), f"a save moved bytes over the grid: {grid.comm_bytes()}"

    group = background_group(grid)
    share = own_share(view.tensors, group)
    (Path(folder) / f"share_{rank}.json").write_text(json.dumps(
        [[key, list(t.offsets) if isinstance(t, Box) else [], t.local.numel() if isinstance(t, Box) else t.numel()]
         for key, t in share.items()]))
    save_state(view.tensors, Path(folder) / "async", grid.world, background=True, background_group=group).result()


def _load(rank: int, world_size: int, argv: list[str], folder: str) -> None:
    """Load into this layout (other initial weights): no grid bytes; each parameter and moment is its box of
    the saved tensor; then write it back to folder/again."""
    from distributed.placement import local_pieces
    from utils.checkpoints.sharded_state import (
        checkpoint_view,
        load_state,
        read_full,
        save_state,
    )

    grid, model, optimizer = _build(argv)
    view = checkpoint_view(model, optimizer, grid, for_load=True)
    grid.reset_comm_bytes()
    load_state(view.tensors, Path(folder) / "sync", grid.world)
    assert not any(grid.comm_bytes().values()), f"a load moved bytes over the grid: {grid.comm_bytes()}"
    full = read_full(Path(folder) / "sync")
    for piece in local_pieces(model):
        box = piece.slices()
        torch.testing.assert_close(piece.local, full[f"model/{piece.name}"][box], rtol=0, atol=0, msg=piece.name)
        for entry, value in optimizer.state[piece.param].items():
            want = full[f"optim/{piece.name}/{entry}"]
            torch.testing.assert_close(_local(value), want if entry == "step" else want[box], rtol=0, atol=0,
                                       msg=f"{piece.name}/{entry}")
    save_state(checkpoint_view(model, optimizer, grid, for_load=False).tensors, Path(folder) / "again", grid.world)


def _expected(argv: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint of the one-process model with the test's moments."""
    from distributed.placement import local_pieces, parameter_names
    from utils.cli.config import load_config
    from utils.tasks import build_task

    cfg, _, _ = load_config(argv)
    torch.manual_seed(cfg.trainer.seed)  # a CPU build initialises from the default generator's seed
    serial = build_task(cfg).build_model()
    want = {f"model/{k}": v for k, v in serial.state_dict().items()}
    first = {id(piece.param): piece.name for piece in local_pieces(serial)}
    for name, param in parameter_names(serial).items():
        want |= {f"optim/{name}/{entry}": moment(first[id(param)], entry, tuple(param.shape)) for entry in MOMENTS}
        want[f"optim/{name}/step"] = torch.tensor(STEP)
    return want


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("model,saved,loaded", CASES, ids=[f"{m}-{s}-to-{t}" for m, s, t in CASES])
def test_boxes_save_and_load_without_collectives(model, saved, loaded, tmp_path, corpus_root):
    from utils.checkpoints.sharded_state import read_full, read_shapes

    argv = [*MODELS[model], f"data.root={corpus_root}", f"run.dir={tmp_path}/run"]
    (ranks, settings), folder = LAYOUTS[saved], tmp_path / "ckpt"
    run_ranks(_save, ranks, tmp_path, [*argv, "trainer.seed=11", *settings], str(folder), timeout_s=240)
    checkpoint = read_full(folder / "sync")
    assert_same(checkpoint, _expected([*argv, "trainer.seed=11"]))
    assert_same(read_full(folder / "async"), checkpoint)
    shares = [item for r in range(ranks) for item in json.loads((folder / f"share_{r}.json").read_text())]
    assert len({(key, tuple(offsets)) for key, offsets, _ in shares}) == len(shares), "an item staged twice"
    shapes = read_shapes(folder / "sync")
    for key in shapes:  # every element of every entry staged by exactly one rank
        assert sum(n for k, _, n in shares if k == key) == torch.Size(shapes[key]).numel(), key

    ranks, settings = LAYOUTS[loaded]
    run_ranks(_load, ranks, tmp_path, [*argv, "trainer.seed=5", *settings], str(folder), timeout_s=240)
    assert_same(read_full(folder / "again"), checkpoint)
