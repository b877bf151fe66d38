"""Hugging Face folders read by slices and written by shards (utils/checkpoints/hf_stream.py).

- The whole-tensor import's vocabulary rows are the stored rows, then zero padding.
- Every box of every tensor (rows and columns; every single row of the fused QKV, across its kv groups and
  its q/k/v parts, and of the gate/up interleave; rows into the padded vocabulary; 1-D tensors; whole tensors)
  read by slices equals the same box of the whole-tensor import (`hf.import_state`), for GPT-2 (Conv1D: boxes
  read transposed, c_attn's parts) and Llama with grouped K/V (2 key/value heads for 4 query heads).
- Under tp2 x FSDP dp2, each rank's pieces read by `init_weights_from` make the one-process import exactly.
- A run started from the folder, its checkpoint exported in shards of a few KiB (model.safetensors.index.json,
  a tensor read and a shard written at a time), loads in transformers with the folder's weights exactly; the
  shards hold what the whole-tensor export (`hf.from_project`) gives.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distributed.placement import Piece
from tests.helpers import make_tokenizer, run_ranks
from tests.test_hf import hf_model
from utils.checkpoints import hf
from utils.checkpoints.hf_stream import read_pieces
from utils.checkpoints.sharded_state import read_full
from utils.export.convert import export_hf, import_hf

transformers = pytest.importorskip("transformers")

KINDS = {"gpt2": "gpt2", "llama_gqa": "llama_gqa_untied_scaled"}  # tests/test_hf.py's random tiny models


@pytest.fixture(scope="module", params=list(KINDS))
def folder(request, tmp_path_factory, corpus_root) -> Path:
    """A Hugging Face folder of a random tiny model with its tokenizer (a vocabulary the run pads)."""
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    make_tokenizer(folder, corpus_root, ["<|endoftext|>"], eos_token="<|endoftext|>")
    vocab = max(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    hf_model(KINDS[request.param], vocab).save_pretrained(folder)
    return folder


def model_config(folder: Path):
    config = hf.read_config(folder)
    arch, settings = hf.model_settings(config)
    return hf.schema_of(arch)(**settings), config["vocab_size"]


def boxes(name: str, shape: tuple[int, ...], gen: torch.Generator) -> list[tuple[slice, ...]]:
    """The whole tensor, random boxes, and every single row (every pair from an odd row) of the fused tensors."""
    out = [tuple(slice(0, n) for n in shape)]
    for _ in range(8):
        starts = [int(torch.randint(0, n, (), generator=gen)) for n in shape]
        out.append(tuple(slice(s, s + int(torch.randint(1, n - s + 1, (), generator=gen)))
                         for s, n in zip(starts, shape)))
    if name.endswith((".qkv.weight", ".qkv.bias", "fc1.weight")):
        rest = tuple(slice(0, n) for n in shape[1:])
        out += [(slice(r, r + 1), *rest) for r in range(shape[0])]
        out += [(slice(r, r + 2), *rest) for r in range(1, shape[0] - 1, 2)]
    if name in ("tok_embed.weight", "lm_head.weight"):  # the last real rows and the padding after them
        out.append((slice(shape[0] - 40, shape[0]), slice(3, 9)))
    return out


def test_every_box_read_by_slices_equals_the_whole_import(folder):
    cfg, vocab = model_config(folder)
    full = hf.import_state(folder, cfg, vocab)
    assert full["tok_embed.weight"].shape[0] > vocab  # padded rows are among the boxes
    stored = hf.read_weights(folder)  # the whole import itself, against the stored rows: each real row, then zeros
    embed = stored.get("transformer.wte.weight", stored.get("model.embed_tokens.weight"))
    assert torch.equal(full["tok_embed.weight"][:vocab], embed) and not full["tok_embed.weight"][vocab:].any()
    gen = torch.Generator().manual_seed(0)
    pieces = []
    for name, tensor in full.items():
        for box in boxes(name, tuple(tensor.shape), gen):
            local = torch.full([s.stop - s.start for s in box], float("nan"))
            pieces.append(Piece(name, local, tuple(tensor.shape), tuple(s.start for s in box)))
    read_pieces(folder, cfg, vocab, pieces)
    for piece in pieces:
        torch.testing.assert_close(piece.local, full[piece.name][piece.slices()], rtol=0, atol=0,
                                   msg=lambda m, p=piece: f"{p.name} box {p.slices()}: {m}")


def run_args(folder: Path, corpus_root: Path, run_dir: Path) -> list[str]:
    """The settings import-hf gives for the folder, and the sample corpus read with its tokenizer."""
    _, settings = import_hf(folder, run_dir / "imported")
    return [*settings, "data=wikitext_sample", f"data.root={corpus_root}", f"data.tokenizer={folder}",
            "data.seq_len=32", "data.sample_tokens=0", "trainer.global_batch_size=4", "trainer.num_workers=0",
            f"run.dir={run_dir}"]


def _import_on_ranks(rank: int, world_size: int, argv: list[str], folder: str, out: str) -> None:
    """This rank's build, its pieces read from the folder by `init_weights_from`, written as a checkpoint."""
    from utils.checkpoints.sharded_state import checkpoint_view, save_state
    from utils.cli.config import load_config
    from utils.comm import init_grid
    from utils.engine.build import build_model, init_weights_from
    from utils.tasks import build_task

    cfg, _, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    task = build_task(cfg)
    model = build_model(cfg, task, grid).raw
    trainer = SimpleNamespace(raw_model=model, cfg=cfg, task=task, grid=grid, log=logging.getLogger(__name__))
    init_weights_from(trainer, Path(folder))
    save_state(checkpoint_view(model, None, grid, for_load=False).tensors, Path(out), grid.world)


@pytest.mark.slow
def test_tp2_fsdp2_ranks_read_the_one_process_import(folder, corpus_root, tmp_path):
    argv = [*run_args(folder, corpus_root, tmp_path), "parallel.tp=2", "parallel.dp_mode=fsdp"]
    run_ranks(_import_on_ranks, 4, tmp_path, argv, str(folder), str(tmp_path / "ranks"), timeout_s=120)
    want = read_full(tmp_path / "imported" / "checkpoints" / "step_0000000")  # import-hf: hf.import_state
    got = {k: v for k, v in read_full(tmp_path / "ranks").items() if k.startswith("model/")}
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_a_run_from_the_folder_exports_in_shards_that_transformers_loads(folder, corpus_root, tmp_path):
    from utils.cli.config import load_config
    from utils.cli.runs import run_digest
    from utils.engine.build import build_run

    cfg, choices, yaml = load_config([*run_args(folder, corpus_root, tmp_path / "run"), f"trainer.init_from={folder}"])
    step = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml)).save_checkpoint()
    config = export_hf(step, tmp_path / "out", shard_bytes=40 * 2**10)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == files
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    assert back.state_dict().keys() == theirs.keys()
    for name, tensor in back.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    state = {k.removeprefix("model/"): v for k, v in read_full(step).items() if k.startswith("model/")}
    whole = hf.from_project(cfg.model, state, config["vocab_size"])
    streamed = hf.read_weights(tmp_path / "out")
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)


def test_the_writer_holds_one_group_at_a_time(tmp_path):
    """write_weights spools each group's bytes as it is produced: when a group is produced, no tensor of an
    earlier one is alive; the files (one shard of 40 bytes at most each, and the index) read back exactly, every
    dtype included."""
    import weakref

    from safetensors.torch import load_file

    from utils.checkpoints.hf_stream import WeightStream, write_weights

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "c": torch.arange(6).view(2, 3),
               "d": torch.tensor(True), "e": torch.randn(2, 2).half()}
    alive = []

    def produce(key: str) -> dict[str, torch.Tensor]:
        assert all(ref() is None for ref in alive), "a tensor of an earlier group is still held"
        tensor = tensors[key].clone()
        alive.append(weakref.ref(tensor))
        return {f"w.{key}": tensor}

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    files = write_weights(tmp_path, WeightStream(sizes, produce), shard_bytes=40)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert files == len(set(index.values())) > 1 and not list(tmp_path.glob("*.data"))
    read = {k: v for name in set(index.values()) for k, v in load_file(tmp_path / name).items()}
    assert read.keys() == {f"w.{k}" for k in tensors}
    for key, tensor in tensors.items():
        assert read[f"w.{key}"].dtype == tensor.dtype and torch.equal(read[f"w.{key}"], tensor), key
