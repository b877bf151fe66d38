"""Sampling (utils/language/task/sampling.py) and `python -m utils.generate` (utils/generate/command.py), on tiny
random models.

- The KV cache: the logits each token is chosen from equal the uncached ones (fp32, 1e-5) and greedy tokens are
  identical, for GPT (learned positions) and Llama (rotary, grouped K/V); the first logits equal the training
  forward's.
- Padding: prompts of different lengths in one batch, padded left or right, continue as each does alone.
- The choice: top-k 1 is greedy, a seed reproduces its samples, top-p keeps the smallest set reaching p, a row
  stops at its end-of-text token.
- The command on a run's checkpoint (2 training steps) and on a Hugging Face folder (transformers' own greedy
  tokens); bad input is one line and exit 2.
"""

from __future__ import annotations

import json

import pytest
import torch

from networks.transformer import GPT
from tests.helpers import QUIET, make_tokenizer, run_main
from utils.cli.config import load_config
from utils.language.task.sampling import GREEDY, Sampling, choose, sample, top_p_mask

VOCAB = 100
PROMPTS = [[5, 17, 3, 42, 8, 9, 11], [7, 2], [60, 61, 62, 63]]


def tiny(preset: str, seed: int = 0) -> GPT:
    cfg = load_config([f"model={preset}", "data=wikitext_sample", "model.depth=2", "model.max_positions=64",
                       "data.seq_len=32"])[0].model
    torch.manual_seed(seed)
    return GPT(cfg, VOCAB).eval()


def run(model, prompts, sampling=GREEDY, new=6, **kwargs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(continuations, the logits of each step)."""
    logits = []
    out = sample(model, prompts, new, sampling, on_logits=lambda step, x: logits.append(x.clone()), **kwargs)
    return out, logits


@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny"])
def test_cached_logits_equal_uncached_and_greedy_tokens_agree(preset):
    model = tiny(preset)
    cached, with_cache = run(model, PROMPTS, cache=True)
    uncached, without = run(model, PROMPTS, cache=False)
    assert cached == uncached and all(len(row) == 6 for row in cached)
    for a, b in zip(with_cache, without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    alone = torch.tensor([PROMPTS[0]])
    with torch.no_grad():  # an unpadded prompt's first logits are the training forward's
        torch.testing.assert_close(with_cache[0][0], model(alone)[0, -1, :VOCAB], rtol=1e-5, atol=1e-5)
        whole = torch.tensor([PROMPTS[0] + cached[0][:-1]])  # and the last ones, of the whole text
        torch.testing.assert_close(with_cache[-1][0], model(whole)[0, -1, :VOCAB], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny"])
def test_a_padded_batch_continues_as_each_prompt_alone(preset, padding):
    model = tiny(preset)
    batch, batch_logits = run(model, PROMPTS, padding=padding)
    for row, prompt in enumerate(PROMPTS):
        alone, logits = run(model, [prompt])
        assert batch[row] == alone[0]
        for a, b in zip(batch_logits, logits, strict=True):
            torch.testing.assert_close(a[row], b[0], rtol=1e-5, atol=1e-5)


def test_top_k_1_is_greedy_and_a_seed_reproduces_its_samples():
    model = tiny("gpt_tiny")
    assert run(model, PROMPTS, Sampling(temperature=1.0, top_k=1))[0] == run(model, PROMPTS)[0]
    warm = Sampling(temperature=1.5, top_k=50, top_p=0.95)
    first, again, other = (run(model, PROMPTS, warm, new=12, seed=s)[0] for s in (3, 3, 4))
    assert first == again and first != other


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    kept = {p: top_p_mask(probs, p).nonzero().flatten().tolist() for p in (0.1, 0.5, 0.79, 0.81, 0.96, 1.0)}
    assert kept == {0.1: [1], 0.5: [1], 0.79: [1, 3], 0.81: [0, 1, 3], 0.96: [0, 1, 2, 3], 1.0: [0, 1, 2, 3]}
    logits = probs.log().expand(4000, 4)
    drawn = choose(logits, Sampling(top_p=0.7), torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and abs(counts[1] / 4000 - 0.5 / 0.8) < 0.03  # renormalised over {1, 3}


def test_a_row_stops_at_its_end_token():
    model = tiny("llama_tiny")
    free = run(model, PROMPTS, new=6)[0]
    eos = free[1][2]
    stopped = run(model, PROMPTS, new=6, eos_id=eos)[0]
    for row, tokens in zip(stopped, free, strict=True):
        assert row == (tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    assert stopped[1][-1] == eos and len(stopped[1]) <= 3


# ----------------------------------------------------------------------------------------------- the command
def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    weather = tmp_path / "weather"
    (weather / "checkpoints" / "step_0000001").mkdir(parents=True)
    (weather / "checkpoints" / "step_0000001" / "COMPLETE").write_text('{"files": []}')  # complete, naming no file
    (weather / "config.yaml").write_text(load_config(["model=vit_tiny"])[2])
    (tmp_path / "empty.txt").write_text("\n\n")
    folder, prompt = str(weather / "checkpoints" / "step_0000001"), ["--prompt", "the"]
    for args, needle in (([str(tmp_path / "missing"), *prompt], "does not exist"),
                         ([folder, *prompt], "not of a GPT or Llama"),
                         ([folder, *prompt, "--top-p", "0"], "--top-p"),
                         ([folder, *prompt, "--top-p", "1.5"], "--top-p"),
                         ([folder, *prompt, "--temperature", "-1"], "--temperature"),
                         ([folder, *prompt, "--max-new-tokens", "0"], "--max-new-tokens"),
                         ([folder, "--prompts", str(tmp_path / "empty.txt")], "holds no prompt"),
                         ([str(tmp_path), *prompt], "holds no complete checkpoint")):
        one_line(*run_main("utils.generate.command", *args)[::2], needle)


def test_the_command_samples_a_checkpoint_of_a_run(tmp_path, corpus_root):
    from utils.cli.runs import run_digest
    from utils.engine.build import build_run

    cfg, choices, yaml = load_config([f"run.dir={tmp_path / 'run'}", "trainer.num_workers=0", "trainer.max_steps=2",
                                      "model=llama_tiny", "data=wikitext_sample", f"data.root={corpus_root}",
                                      "data.seq_len=32", "trainer.global_batch_size=4", "model.depth=2"])
    trainer = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))
    batches = iter(trainer.loaders.train)
    for _ in range(2):
        trainer.train_step(*next(batches))
        trainer.step += 1
    step = str(trainer.save_checkpoint())
    (tmp_path / "prompts.txt").write_text("the first\n\nin the year of\n")
    texts = {}
    for extra in ([], ["--no-kv-cache"], ["--padding", "right"]):
        code, out, err = run_main("utils.generate.command", step, "--prompts", str(tmp_path / "prompts.txt"),
                                  "--temperature", "0", "--max-new-tokens", "8", *extra)
        assert code == 0, err
        texts[tuple(extra)] = out
    assert len(set(texts.values())) == 1 and "tokens/s" in err
    tokenizer = trainer.task.corpus.tokenizer
    prompts = tokenizer.encode_batch(["the first", "in the year of"])
    want = sample(trainer.raw_model, prompts, 8, GREEDY, eos_id=tokenizer.eos_id)
    assert out.startswith(tokenizer.decode(prompts[0] + [t for t in want[0] if t != tokenizer.eos_id]))


@pytest.mark.slow  # transformers' import alone takes seconds
def test_the_command_samples_a_hugging_face_folder_as_transformers_does(tmp_path, corpus_root):
    transformers = pytest.importorskip("transformers")
    folder = make_tokenizer(tmp_path / "gpt2", corpus_root, ["<|endoftext|>"])
    vocab = max(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                                                  n_positions=64)).eval()
    theirs.save_pretrained(folder)
    code, out, err = run_main("utils.generate.command", str(folder), "--prompt", "The city of", "--temperature", "0",
                              "--max-new-tokens", "10")
    assert code == 0, err
    from utils.language.data.tokenizers import PretrainedTokenizer

    tokenizer = PretrainedTokenizer.load(str(folder))
    ids = tokenizer.encode_batch(["The city of"])
    tokens = theirs.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=tokenizer.eos_id)[0].tolist()
    assert out.rstrip("\n") == tokenizer.decode([t for t in tokens if t != tokenizer.eos_id])


@pytest.mark.slow
def test_the_command_reads_a_tp2_pp2_checkpoint_as_export_does(tmp_path, corpus_root):
    """A checkpoint written under tp2 x pp2 samples as the one-process model of its exported file does."""
    from tests.rank_pool import run_entry_ranks

    args = ["model=llama_tiny", "model.depth=2", "data=wikitext_sample", f"data.root={corpus_root}", "data.seq_len=32",
            "data.sample_tokens=0", "trainer.global_batch_size=4", "trainer.max_steps=2", *QUIET, "parallel=pp2",
            "parallel.tp=2", f"run.dir={tmp_path / 'run'}"]
    results = run_entry_ranks(args)
    assert [r.value for r in results] == [0] * 4, results[0].stderr[-3000:]
    step = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert run_main("utils.export.convert", "export", str(step), str(tmp_path / "model.pt"))[0] == 0
    cfg = load_config(args)[0]
    from utils.tasks import build_task

    task = build_task(cfg)
    plain = task.build_model()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"])
    tokenizer = task.corpus.tokenizer
    prompts = tokenizer.encode_batch(["the first", "in the year of"])
    want = sample(plain, prompts, 8, GREEDY, eos_id=tokenizer.eos_id)
    (tmp_path / "prompts.txt").write_text("the first\nin the year of\n")
    code, out, err = run_main("utils.generate.command", str(step), "--prompts", str(tmp_path / "prompts.txt"),
                              "--temperature", "0", "--max-new-tokens", "8")
    assert code == 0, err
    trim = [[t for t in w if t != tokenizer.eos_id] for w in want]
    assert out == "\n\n".join(tokenizer.decode(p + w) for p, w in zip(prompts, trim, strict=True)) + "\n"
