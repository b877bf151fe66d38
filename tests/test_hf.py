"""Weights exchanged with Hugging Face `transformers` (utils/checkpoints/hf.py), models built from random configs.

- GPT-2 and Llama (grouped K/V, tied and untied heads, Llama 3.1's frequency scaling): for the same weights our
  logits equal transformers' within 1e-5 (fp32) after import, and transformers' equal ours after export
  (`from_pretrained` of the folder written); greedy generation gives the same tokens.
- The workflow: a Hugging Face folder (weights and a tokenizer) -> import-hf -> a fine-tune under tp2 x pp2 on
  the sample corpus read with that tokenizer -> export-hf -> `from_pretrained` gives our one-process logits.
- A pretrained model trains from its folder under tp2 x pp2, cp2 and fsdp dp2 on the single-process curve.
- Bad folders and mismatched settings: one line, exit 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from networks.exchange import Rule, assemble, disassemble
from tests.helpers import QUIET, make_tokenizer, read_scalars, run_main
from tests.rank_pool import run_entry_ranks
from utils.checkpoints import hf
from utils.checkpoints.hf_stream import write_folder
from utils.checkpoints.sharded_state import read_full
from utils.comm import Axis, Grid
from utils.export.convert import main as export_main
from utils.language.data.tokenizers import PretrainedTokenizer
from utils.language.task.generate import greedy_decode

transformers = pytest.importorskip("transformers")

VOCAB = 100
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5)
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
MODELS = {
    "gpt2": lambda vocab: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "llama_gqa_untied_scaled": lambda vocab: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, **LLAMA, tie_word_embeddings=False, rope_scaling=SCALING)),
    "llama_tied": lambda vocab: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, **{**LLAMA, "num_key_value_heads": 4}, tie_word_embeddings=True)),
}


def hf_model(kind: str, vocab: int = VOCAB, seed: int = 0):
    """A random transformers model in eval mode; norms and biases perturbed (they start at 1 and 0)."""
    torch.manual_seed(seed)
    model = MODELS[kind](vocab).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def ours_from(folder: Path):
    """Our one-process model with the weights of a Hugging Face folder, and its config."""
    from networks.transformer import GPT

    config = json.loads((folder / "config.json").read_text())
    arch, settings = hf.model_settings(config)
    cfg = hf.schema_of(arch)(**settings)
    model = GPT(cfg, config["vocab_size"]).eval()
    model.load_state_dict(hf.import_state(folder, cfg, config["vocab_size"]))
    return model, cfg


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_and_greedy_tokens_equal_transformers_both_ways(tmp_path, kind):
    theirs = hf_model(kind)
    ours, cfg = ours_from(save(theirs, tmp_path / "in"))
    x = torch.randint(VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(x).logits
        torch.testing.assert_close(ours(x)[..., :VOCAB], want, rtol=1e-5, atol=1e-5)
    # export: transformers reads what we write
    write_folder(tmp_path / "out", hf.hf_config(cfg, VOCAB), hf.from_project(cfg, ours.state_dict(), VOCAB), None)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    back.eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x)[..., :VOCAB], rtol=1e-5, atol=1e-5)
    prompts = x[:, :8]
    tokens = greedy_decode(ours, prompts, 12, tp=Grid.serial().axis(Axis.TP))
    generated = back.generate(prompts, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(tokens, generated)


def test_fused_layouts_invert():
    """The rules one table states (networks/exchange.py): import assembles ours from theirs, export gives them
    back."""
    q, k, v = torch.randn(8 * 3, 5), torch.randn(2 * 3, 5), torch.randn(2 * 3, 5)  # 8 query heads, 2 groups, hd 3
    qkv = Rule("qkv", ("q", "k", "v"), (0, 0, 0), False, group=(4 * 3, 3))
    fused = assemble(qkv, (36, 5), {"q": q, "k": k, "v": v})
    assert torch.equal(fused[:4 * 3], q[:4 * 3]) and torch.equal(fused[4 * 3:5 * 3], k[:3])  # group 0: its q, k, v
    assert torch.equal(fused[5 * 3:6 * 3], v[:3]) and torch.equal(fused[6 * 3:10 * 3], q[4 * 3:])  # then group 1
    back = disassemble(qkv, fused, {"q": (24, 5), "k": (6, 5), "v": (6, 5)})
    assert all(torch.equal(back[n], t) for n, t in zip("qkv", (q, k, v)))
    conv = torch.randn(5, 3 * 12)  # GPT-2's c_attn: (in, out), out ordered ({q, k, v}, head, hd): 4 heads of 3
    fused_rule = Rule("qkv", ("c",) * 3, (0, 12, 24), True, group=(3, 3))
    ours = assemble(fused_rule, (36, 5), {"c": conv})
    assert torch.equal(ours[:9], conv.t()[[0, 1, 2, 12, 13, 14, 24, 25, 26]])  # head 0: its q, k, v rows
    assert torch.equal(disassemble(fused_rule, ours, {"c": (5, 36)})["c"], conv)
    gate, up = torch.randn(4, 5), torch.randn(4, 5)
    gate_up = Rule("gate_up", ("g", "u"), (0, 0), False)
    rows = assemble(gate_up, (8, 5), {"g": gate, "u": up})
    assert torch.equal(rows[0::2], gate) and torch.equal(rows[1::2], up)
    padded = assemble(Rule("same", ("e",), (0,), False, real_rows=3), (4, 5), {"e": up[:3]})
    assert torch.equal(padded[:3], up[:3]) and not padded[3].any()  # the vocabulary's padding row is zero


# ------------------------------------------------------------------------------------------------ workflow
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus_root) -> Path:
    """A 'pretrained' Llama folder as one is downloaded: weights, config.json and its tokenizer files."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    make_tokenizer(folder, corpus_root, ["<|end_of_text|>", "<|begin_of_text|>"], eos_token="<|end_of_text|>")
    vocab = json.loads((folder / "tokenizer.json").read_text())
    size = max(vocab["model"]["vocab"].values()) + 1
    save(hf_model("llama_gqa_untied_scaled", size), folder)
    return folder


def llama_args(folder: Path, corpus_root: Path) -> list[str]:
    """The model settings import-hf prints for the folder, and the data read with its tokenizer."""
    code, out, err = run_main("utils.export.convert", "import-hf", str(folder), str(folder.parent / "imported"))
    assert code == 0, err
    settings = re.search(r"python train\.py (.*) data=wikitext_sample data\.tokenizer=", out).group(1).split()
    return [*settings, "data=wikitext_sample", f"data.root={corpus_root}", f"data.tokenizer={folder}",
            "data.seq_len=32", "data.limit_eval_tokens=2048", "data.sample_tokens=0", "optim.lr=2e-3",
            "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.log_every=1", *QUIET]


def curve(run_dir: Path) -> list[float]:
    return [v for _, v in read_scalars(run_dir)["train/loss"]]


def run(args: list[str], run_dir: Path) -> Path:
    results = run_entry_ranks([*args, f"run.dir={run_dir}"])
    assert [r.value for r in results] == [0] * len(results), next(r.stdout[-1500:] + r.stderr[-3000:]
                                                                  for r in results if r.value)
    return run_dir


@pytest.fixture(scope="module")
def single(pretrained, corpus_root, tmp_path_factory):
    args = llama_args(pretrained, corpus_root)
    return args, curve(run([*args, f"trainer.init_from={pretrained}"], tmp_path_factory.mktemp("single")))


@pytest.mark.slow
def test_import_finetune_tp2pp2_export_loads_in_transformers(pretrained, single, tmp_path):
    """import-hf's step folder under tp2 x pp2 follows the one-process run from the folder itself; its final
    checkpoint exported loads in transformers with our one-process logits, tokenizer files beside it: AutoTokenizer
    reads them to the folder's ids, and config.json's end and beginning tokens are the tokenizer's."""
    args, reference = single
    imported = pretrained.parent / "imported" / "checkpoints" / "step_0000000"
    run_dir = run([*args, "parallel=pp2", "parallel.tp=2", f"trainer.init_from={imported}"], tmp_path / "tp2pp2")
    assert curve(run_dir) == pytest.approx(reference, rel=1e-4)
    step = run_dir / "checkpoints" / "step_0000004"
    assert export_main(["export-hf", str(step), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()
    from networks.transformer import GPT

    _, cfg = ours_from(pretrained)
    vocab = json.loads((pretrained / "config.json").read_text())["vocab_size"]
    ours = GPT(cfg, vocab).eval()
    ours.load_state_dict({k.removeprefix("model/"): v for k, v in read_full(step).items() if k.startswith("model/")})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(vocab, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x)[..., :vocab], rtol=1e-5, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")  # the folder's tokenizer_config.json
    assert theirs.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert theirs.config.bos_token_id is tokenizer.bos_token_id is None  # not Llama's default 1: it names none
    text = "The game was released in Japan.\nIt sold <|end_of_text|> well"
    assert tokenizer(text)["input_ids"] == PretrainedTokenizer.load(str(pretrained)).encode_batch([text])[0]


@pytest.mark.parametrize("layout", [["parallel=pp2", "parallel.tp=2"], ["parallel=cp2"],
                                    ["parallel.dp=2", "parallel.dp_mode=fsdp"]], ids=["tp2pp2", "cp2", "fsdp_dp2"])
@pytest.mark.slow
def test_a_pretrained_model_trains_under_every_layout(pretrained, single, tmp_path, layout):
    """From the folder itself (each rank cuts its tp shard, its stages, its FSDP shard) under tp2 x pp2, cp2 and
    FSDP; the test above starts tp2 x pp2 from import-hf's checkpoint instead."""
    args, reference = single
    run_dir = run([*args, *layout, f"trainer.init_from={pretrained}"], tmp_path / "run")
    assert curve(run_dir) == pytest.approx(reference, rel=1e-4)


# ---------------------------------------------------------------------------------------------- bad input
def one_line(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert all(n in lines[0] for n in needles), lines[0]


def test_bad_folders_are_refused_with_one_line(tmp_path):
    cases = {}
    other = save(hf_model("llama_tied"), tmp_path / "bert")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    cases["bert"] = (other, "model_type is 'bert'")
    (tmp_path / "empty").mkdir()
    cases["empty"] = (tmp_path / "empty", "holds no config.json")
    missing = save(hf_model("llama_tied"), tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    cases["no weights"] = (missing, "safetensors")
    deeper = save(hf_model("llama_tied"), tmp_path / "deeper")
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    cases["a missing layer"] = (deeper, "lack model.layers.2.")
    wider = save(hf_model("llama_tied"), tmp_path / "wider")
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    cases["other shapes"] = (wider, "has shape")
    for name, (folder, needle) in cases.items():
        code, _, err = run_main("utils.export.convert", "import-hf", str(folder), str(tmp_path / f"run_{name}"))
        one_line(code, err, needle)
        assert not (tmp_path / f"run_{name}" / "checkpoints").exists()  # refused before writing anything


@pytest.mark.slow
def test_init_from_a_folder_of_another_model_is_refused_before_work(pretrained, corpus_root, tmp_path):
    args = llama_args(pretrained, corpus_root)
    code, _, err = run_main("train.py", *args, "model.embed_dim=128", f"trainer.init_from={pretrained}",
                            f"run.dir={tmp_path / 'a'}")
    one_line(code, err, "(model)", "model.embed_dim=64")
    code, _, err = run_main("train.py", *[a for a in args if not a.startswith("data.tokenizer=")],
                            f"trainer.init_from={pretrained}", f"run.dir={tmp_path / 'b'}")
    one_line(code, err, "(data.tokenizer)", f"data.tokenizer={pretrained}")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "checkpoints").exists()


def test_a_sharded_folder_reads_as_one_file(tmp_path):
    """Weights split over shards listed by model.safetensors.index.json (as large models ship) read as one file."""
    model = hf_model("llama_gqa_untied_scaled")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    one, sharded = (hf.read_folder(tmp_path / name)[1] for name in ("one", "sharded"))
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
