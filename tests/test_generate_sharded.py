"""`python -m utils.generate` launched on several ranks: sampling under tensor parallelism
(utils/language/task/sampling.py
`sample(tp=...)`, the model built by utils/engine/session.py).

- tp2 on 2 gloo ranks, KV cache on, a padded batch: the logits each token is chosen from equal one process's
  (fp32, 1e-5) and the greedy tokens are identical, for a tiny GPT (learned positions, tied head) and a tiny Llama
  (rotary, grouped K/V, untied head); the command prints one process's text on rank 0 and nothing on rank 1.
- A seeded draw (temperature, top-k, top-p) picks the same tokens on both ranks and as one process.
- A layout whose tp does not divide the heads is one line on stderr and exit 2.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from networks.transformer import GPT
from tests.helpers import run_main, run_ranks
from utils.checkpoints.hf import from_project, hf_config
from utils.checkpoints.hf_stream import write_folder
from utils.cli.config import load_config
from utils.engine.session import open_model
from utils.language.data.tokenizers import PretrainedTokenizer
from utils.language.task.sampling import GREEDY, Sampling, sample

WORDS = [f"w{i}" for i in range(40)]
PROMPTS = ["w1 w2 w3 w4 w5 w6", "w7", "w8 w9 w10"]
NEW = 6
WARM = Sampling(temperature=1.3, top_k=20, top_p=0.95)


def hf_folder(tmp: Path, preset: str, **model) -> Path:
    """A Hugging Face folder of a tiny random `preset` model (depth 2) with a word-level tokenizer."""
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tmp / "tokenizer.json"))
    cfg = load_config([f"model={preset}", "data=wikitext_sample", "model.depth=2", "model.max_positions=32",
                       "data.seq_len=16", *(f"model.{k}={v}" for k, v in model.items())])[0].model
    torch.manual_seed(0)
    net = GPT(cfg, len(vocab)).eval()
    write_folder(tmp / "hf", hf_config(cfg, len(vocab), 0), from_project(cfg, net.state_dict(), len(vocab)),
                 [tmp / "tokenizer.json"])
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return tmp / "hf"


def sampled(model, tokenizer, sampling: Sampling, tp=None) -> tuple[list[list[int]], torch.Tensor]:
    """(tokens, the logits of every step (steps, B, V)) of the prompts, KV cache on, padded left."""
    logits = []
    tokens = sample(model, tokenizer.encode_batch(PROMPTS), NEW, sampling, seed=3, tp=tp,
                    on_logits=lambda step, x: logits.append(x.clone()))
    return tokens, torch.stack(logits)


def command(folder: Path, *extra: str) -> list[str]:
    return [str(folder), "--prompts", str(folder.parent / "prompts.txt"), "--max-new-tokens", str(NEW), *extra]


def _sample_on_rank(rank: int, world: int, folder: str, out: str) -> None:
    from utils.comm import Axis
    from utils.engine.session import open_model
    from utils.generate.command import main

    tokenizer = PretrainedTokenizer.load(folder)
    model, grid = open_model(Path(folder), "DIR", kind="wikitext").sharded(tp=world, pp=1, sequence_parallel=False)
    assert model.lm_head.weight.shape[0] < model.padded_vocab  # this rank's vocabulary columns only
    greedy = sampled(model, tokenizer, GREEDY, grid.axis(Axis.TP))
    warm = sampled(model, tokenizer, WARM, grid.axis(Axis.TP))
    printed, logged = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(logged):
        assert main(command(Path(folder), "--temperature", "0")) == 0
    torch.save({"greedy": greedy, "warm": warm, "printed": printed.getvalue(), "logged": logged.getvalue()},
               f"{out}.{rank}")


@pytest.mark.slow  # two model builds on two ranks and the same in one process: ~10 s
@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny"])
def test_tp2_samples_as_one_process(tmp_path, preset):
    folder = hf_folder(tmp_path, preset)
    tokenizer = PretrainedTokenizer.load(str(folder))
    alone = open_model(folder, "DIR", kind="wikitext").serial("cpu")
    want_greedy, want_warm = sampled(alone, tokenizer, GREEDY), sampled(alone, tokenizer, WARM)
    code, want_text, _ = run_main("utils.generate.command", *command(folder, "--temperature", "0"))
    assert code == 0
    run_ranks(_sample_on_rank, 2, tmp_path, str(folder), str(tmp_path / "out"), timeout_s=150)
    ranks = [torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(2)]
    for got in ranks:
        assert got["greedy"][0] == want_greedy[0] and got["warm"][0] == want_warm[0]
        torch.testing.assert_close(got["greedy"][1], want_greedy[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["warm"][1], want_warm[1], rtol=1e-5, atol=1e-5)
    assert ranks[0]["printed"] == want_text and want_text.count("\n\n") == len(PROMPTS) - 1
    assert "tp2" in ranks[0]["logged"] and ranks[1]["printed"] == ranks[1]["logged"] == ""


def _bad_layout_on_rank(rank: int, world: int, folder: str) -> None:
    from utils.generate.command import main

    logged = io.StringIO()
    with contextlib.redirect_stderr(logged), pytest.raises(SystemExit) as exit_:
        main(command(Path(folder), "--temperature", "0"))
    err = logged.getvalue()
    assert exit_.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert "num_heads=3 is not divisible by parallel.tp=2" in err, err


def test_a_tp_that_does_not_divide_the_heads_is_one_line_and_exit_2(tmp_path):
    folder = hf_folder(tmp_path, "gpt_tiny", num_heads=3, embed_dim=48)
    run_ranks(_bad_layout_on_rank, 2, tmp_path, str(folder), timeout_s=60)
