"""Evaluation: `python -m utils.evaluate` (utils/evaluate/) and validation's bits per byte
(utils/language/task/language.py).

- Items built so that the right choice is the model's own greedy continuation (a tiny random Llama whose logits
  are sharpened) and the wrong ones random words: accuracy 1.0 under every normalization.
- Each choice's score equals a float64 computation from the model's logits; batches padded or not agree.
- Launched on 2 gloo ranks under tp2 and under pp2 the command prints and writes what one process does.
- Bad items are one line naming the line, exit 2; a context longer than the model's positions is cut on the left.
- Bytes per token add up to the decoded text (word: exactly; byte-level BPE: with each line's prefix space).
- val/bpb of a tiny validation set equals the summed float64 NLL over ln 2 x the bytes of the decoded targets.
"""

from __future__ import annotations

import contextlib
import json
import math
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from networks.transformer import GPT
from tests.helpers import run_main, run_ranks
from utils.checkpoints.hf import from_project, hf_config
from utils.checkpoints.hf_stream import write_folder
from utils.cli.config import load_config
from utils.comm import Grid
from utils.evaluate.items import build_requests, read_items
from utils.evaluate.scoring import choice_scores, log_likelihoods
from utils.language.data.token_bytes import token_bytes
from utils.language.data.tokenizers import BPETokenizer, PretrainedTokenizer
from utils.language.task.sampling import GREEDY, sample

WORDS = [f"w{i}" for i in range(40)]
EOS = "<|endoftext|>"
NUM_ITEMS, NEW = 8, 3


def tiny_cfg(**data):
    overrides = ["model=llama_tiny", "data=wikitext_sample", "model.depth=2", "model.embed_dim=64",
                 "model.max_positions=32", "data.seq_len=16"]
    return load_config(overrides + [f"data.{k}={v}" for k, v in data.items()])[0]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(Hugging Face folder of a tiny Llama with sharpened logits and a word-level tokenizer, items file)."""
    tmp = tmp_path_factory.mktemp("evaluate")
    vocab = {w: i for i, w in enumerate([EOS, "[UNK]", *WORDS])}
    hf_tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf_tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok.decoder = decoders.WordPiece()  # joins words with spaces
    hf_tok.save(str(tmp / "tokenizer.json"))
    tokenizer = PretrainedTokenizer.load(str(tmp))
    cfg = tiny_cfg().model
    torch.manual_seed(0)
    model = GPT(cfg, len(vocab)).eval()
    with torch.no_grad():
        model.norm.weight.mul_(40.0)  # peaked next-token distributions: the greedy continuation stands out
    folder = tmp / "hf"
    write_folder(folder, hf_config(cfg, len(vocab), tokenizer.eos_id),
                 from_project(cfg, model.state_dict(), len(vocab)), [tmp / "tokenizer.json"])
    rng = random.Random(0)
    lines = []
    for _ in range(NUM_ITEMS):
        context = " ".join(rng.choices(WORDS, k=5))
        greedy = sample(model, tokenizer.encode_batch([context]), NEW, GREEDY)[0]
        right = " " + tokenizer.decode(greedy)
        wrong = [" " + " ".join(rng.choices([w for w in WORDS if vocab[w] != greedy[0]], k=NEW)) for _ in range(3)]
        answer = rng.randrange(4)
        lines.append(json.dumps({"context": context, "choices": wrong[:answer] + [right] + wrong[answer:],
                                 "answer": answer}))
    (tmp / "items.jsonl").write_text("\n".join(lines) + "\n")
    return folder, tmp / "items.jsonl", model, tokenizer


def evaluate(*args) -> tuple[str, dict]:
    folder, path = args[:2]
    out = path.parent / f"out_{abs(hash(args))}.json"
    code, stdout, err = run_main("utils.evaluate.command", str(folder), "--task", str(path), "--output", str(out),
                                 *args[2:])
    assert code == 0, err
    return stdout, json.loads(out.read_text())


@pytest.mark.parametrize("normalize", ["sum", "length", "bytes"])
def test_the_greedy_continuation_is_always_chosen(source, normalize):
    folder, items, _, _ = source
    stdout, result = evaluate(folder, items, "--normalize", normalize, "--batch", "3")
    assert result["accuracy"] == 1.0 and result["stderr"] == 0.0 and result["items"] == NUM_ITEMS
    bound = 1 - 3 / NUM_ITEMS  # the rule of three: no standard error of 0 at p = 1
    assert stdout.startswith(f"accuracy 1.0000 (above {bound:.4f} at 95%) ({NUM_ITEMS} items, normalize={normalize})")
    assert [r["predicted"] for r in result["per_item"]] == [r["answer"] for r in result["per_item"]]


def test_scores_equal_a_float64_computation_from_the_logits(source):
    folder, path, model, tokenizer = source
    items = read_items(path)
    requests = build_requests(items, tokenizer, model.cfg.max_positions, path)
    reference = model.double()
    want = []
    with torch.no_grad():
        for r in requests:
            logp = torch.log_softmax(reference(torch.tensor([r.ids[:-1]]))[0, :, :reference.vocab_size], dim=-1)
            rows = torch.arange(len(r.ids) - 1 - r.num_scored, len(r.ids) - 1)
            want.append(logp[rows, torch.tensor(r.ids[-r.num_scored:])].sum().item())
    model.float()
    for batch in (1, 5):  # padded batches of unequal lengths, and none
        got = log_likelihoods(model, requests, batch, torch.device("cpu"))
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-3)
    _, result = evaluate(folder, path, "--normalize", "length")
    per_token = choice_scores(items, requests, want, "length")
    torch.testing.assert_close(torch.tensor([r["scores"] for r in result["per_item"]], dtype=torch.float64),
                               torch.tensor(per_token, dtype=torch.float64), rtol=1e-4, atol=1e-3)


def test_a_long_context_is_cut_on_the_left(source, tmp_path):
    _, _, model, tokenizer = source
    path = tmp_path / "long.jsonl"
    context = " ".join(WORDS[i % len(WORDS)] for i in range(50))
    path.write_text(json.dumps({"context": context, "choices": [" w1 w2", " w3"], "answer": 0}) + "\n")
    items = read_items(path)
    requests = build_requests(items, tokenizer, model.cfg.max_positions, path)
    whole = tokenizer.encode_batch([context + " w1 w2"])[0]
    assert requests[0].ids == whole[-(model.cfg.max_positions + 1):] and requests[0].num_scored == 2
    got = log_likelihoods(model, requests, 2, torch.device("cpu"))[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[-33:-1]]))[0, :, :model.vocab_size].double(), dim=-1)
    assert got == pytest.approx(logp[-2, whole[-2]].item() + logp[-1, whole[-1]].item(), rel=1e-5)


def test_token_bytes_add_up_to_the_decoded_text():
    from utils.language.data.tokenizers import WordTokenizer

    lines = ["the cat sat", "a zebra on the mat quietly", "caf\u00e9 na\u00efve"]
    word = WordTokenizer.train(lines)
    table = token_bytes(word)
    for ids in word.encode_batch(lines):  # a word and its separator; the line's newline is its last word's
        assert table[ids + [word.eos_id]].sum() == len(word.decode(ids + [word.eos_id]).encode("utf-8"))
    bpe = BPETokenizer.train(lines, 300)
    table = token_bytes(bpe)
    for ids in bpe.encode_batch(lines):  # byte-level: exact, with the space the encoder puts before each line
        assert table[ids + [bpe.eos_id]].sum() == len((" " + bpe.decode(ids) + "\n").encode("utf-8"))


def _evaluate_on_rank(rank: int, world: int, folder: str, path: str, out: str, layout: list[str]) -> None:
    from utils.evaluate.command import main

    assert main([folder, "--task", path, "--output", out, "--batch", "3", *layout]) == 0


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]])
def test_two_ranks_score_as_one_process(source, tmp_path, layout):
    folder, path, _, _ = source
    _, alone = evaluate(folder, path, "--batch", "3")
    out = tmp_path / "sharded.json"
    run_ranks(_evaluate_on_rank, 2, tmp_path, str(folder), str(path), str(out), layout, timeout_s=150)
    sharded = json.loads(out.read_text())
    assert sharded["accuracy"] == alone["accuracy"] == 1.0
    torch.testing.assert_close(torch.tensor([r["scores"] for r in sharded["per_item"]]),
                               torch.tensor([r["scores"] for r in alone["per_item"]]), rtol=1e-5, atol=1e-4)


def test_a_bad_item_is_one_line_naming_it(source, tmp_path):
    folder = str(source[0])
    good = '{"context": "w1 w2", "choices": [" w3", " w4"], "answer": 1}'
    for bad, needle in (("{not json", "line 2 is not JSON"),
                        ('{"context": "w1", "choices": [" w3"], "answer": 0}', "line 2: choices"),
                        ('{"context": "w1", "choices": [" w3", " w4"], "answer": 2}', "line 2: answer 2"),
                        ('{"context": "", "choices": [" w3", " w4"], "answer": 0}', "line 2: context"),
                        ('{"choices": [" w3", " w4"], "answer": 0}', "line 2 has no context")):
        (tmp_path / "items.jsonl").write_text(good + "\n" + bad + "\n")
        code, _, err = run_main("utils.evaluate.command", folder, "--task", str(tmp_path / "items.jsonl"))
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and needle in err, err


def test_validation_bits_per_byte_against_a_hand_computation():
    from utils.language.task.language import LanguageTask

    rng = random.Random(1)
    lines = [" ".join(rng.choices(["the", "cat", "sat", "on", "a", "mat", "zebra", "quietly"], k=7)) for _ in range(40)]
    bpe = BPETokenizer.train(lines, 300)
    ids = [i for line in bpe.encode_batch(lines) for i in [*line, bpe.eos_id]]
    cfg = tiny_cfg(sample_tokens=0)
    blocks = torch.tensor(ids[:6 * 17]).view(6, 17)  # six validation rows of 16 inputs and 16 targets
    loader = [(blocks[:4, :-1], blocks[:4, 1:]), (blocks[4:, :-1], blocks[4:, 1:])]
    task = LanguageTask(cfg.data, cfg.model)
    task.token_bytes = torch.from_numpy(token_bytes(bpe))
    torch.manual_seed(0)
    model = GPT(cfg.model, bpe.vocab_size).eval()
    metrics = task.evaluate(model, model.criterion, loader, grid=Grid.serial(), autocast=contextlib.nullcontext,
                            writer=None, step=0)
    with torch.no_grad():
        logp = torch.log_softmax(model.double()(blocks[:, :-1])[..., :bpe.vocab_size], dim=-1)
    nll = -logp.gather(-1, blocks[:, 1:, None]).sum().item()
    text_bytes = 0  # the targets' decoded text: ASCII segments between end tokens, each end token a newline
    for row in blocks[:, 1:].tolist():
        segments = [[]]
        for i in row:
            segments.append([]) if i == bpe.eos_id else segments[-1].append(i)
        text_bytes += sum(len(bpe.tokenizer.decode(s).encode("utf-8")) for s in segments) + len(segments) - 1
    assert metrics["val/bpb"] == pytest.approx(nll / (math.log(2) * text_bytes), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(nll / blocks[:, 1:].numel(), rel=1e-5)
