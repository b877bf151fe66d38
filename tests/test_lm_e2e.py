"""The language model through train.py: perplexity falls below the unigram baseline; bad input."""

import math

import pytest

from tests.helpers import read_scalars, read_tags, run_entry, run_main

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

LM = ["model=gpt_tiny", "data=wikitext_sample", "trainer.num_workers=0", "trainer.log_every=20"]


def test_gpt_tiny_beats_unigram(tmp_path, corpus_root):
    run_dir = tmp_path / "lm"
    # one validation, on 16k tokens: the test of quality, not of the reader
    proc = run_entry("train.py", *LM, f"data.root={corpus_root}", f"run.dir={run_dir}", "trainer.max_steps=120",
                     "trainer.val_every=0", "trainer.val_at_start=false", "data.limit_eval_tokens=16384",
                     "optim.lr=2e-3", "data.seq_len=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram ppl" in proc.stdout
    unigram = float(proc.stdout.split("unigram ppl ")[-1].split(")")[0])
    scalars = read_scalars(run_dir)
    for tag in ("train/loss", "val/loss", "val/ppl", "perf/tokens_per_sec", "perf/tflops_per_sec"):
        assert tag in scalars, tag
    assert any(tag.startswith("val/samples") for tag in read_tags(run_dir)["tensors"])  # greedy continuations
    ppl = scalars["val/ppl"][-1][1]
    assert ppl < unigram / 4, (ppl, unigram)
    assert ppl == pytest.approx(math.exp(scalars["val/loss"][-1][1]), rel=1e-4)


@pytest.mark.parametrize("args,setting", [
    (["data.seq_len=512"], "data.seq_len"),  # above gpt_tiny's 256 positions
    (["data.tokenizer=char"], "data.tokenizer"),
    (["data=wikitext", "data.root=/nonexistent"], "data.root"),
    (["model=vit_tiny"], "data"),  # the error names the data that fits the model, then the models that fit the data
])
def test_lm_bad_input(args, setting, tmp_path, corpus_root):
    code, _, err = run_main("train.py", *LM, f"data.root={corpus_root}", f"run.dir={tmp_path}", *args)
    assert code == 2, err
    assert err.startswith("error: ") and f"({setting}" in err and "Traceback" not in err


def test_missing_split_and_empty_corpus(tmp_path):
    folder = tmp_path / "wikitext-2"
    folder.mkdir()
    (folder / "wiki.train.tokens").write_text(" = A = \n the cat sat . \n")
    code, _, err = run_main("train.py", *LM, "data=wikitext", f"data.root={tmp_path}")
    assert code == 2 and "lacks the valid" in err, err
    for split in ("train", "valid", "test"):
        (folder / f"wiki.{split}.tokens").write_text("\n \n")
    code, _, err = run_main("train.py", *LM, "data=wikitext", f"data.root={tmp_path}")
    assert code == 2 and err.startswith("error: "), err
