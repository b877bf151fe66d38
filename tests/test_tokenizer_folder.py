"""data.tokenizer=PATH: a pretrained model's tokenizer.json read as it ships, on the sample corpus.

The tokenizers here are tiny byte-level BPEs trained on the sample corpus and saved in the Hugging Face
layout (tokenizer.json, optionally tokenizer_config.json), standing in for GPT-2's and Llama's: the end
token comes from the config or from the known names, a BOS-adding post-processor is not applied per
line, the vocabulary counts the added tokens, and the id caches are keyed by the tokenizer file.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.helpers import QUIET, TINY_GPT, corpus_lines, make_tokenizer, run_entry, run_main
from utils import ConfigError
from utils.language.data import wikitext as wt
from utils.language.data.corpus import ensure_sample_corpus
from utils.language.data.tokenizers import PretrainedTokenizer
from utils.language.data.wikitext import WikiTextConfig, load_wikitext


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The sample corpus in a folder of this module's own (the id caches are written beside it)."""
    return ensure_sample_corpus(tmp_path_factory.mktemp("corpus") / "sample")


def load(sample: Path, tokenizer: Path | str, **kw):
    return load_wikitext(WikiTextConfig(root=str(sample), sample=True, tokenizer=str(tokenizer), **kw))


def check_lines(data, sample: Path, eos_id: int) -> None:
    """Every non-blank line of every split is its own encoding followed by the end token, and decodes back."""
    tok = data.tokenizer
    for split in wt.SPLITS:
        ids, lines = np.asarray(getattr(data, split)), corpus_lines(sample, split)
        assert ids[-1] == eos_id and int((ids == eos_id).sum()) == len(lines), split
        assert tok.decode(ids) == "".join(line + "\n" for line in lines), split
    first = np.asarray(data.valid)[:np.flatnonzero(np.asarray(data.valid) == eos_id)[0]]
    assert first.tolist() == tok.encode_batch(corpus_lines(sample, "valid")[:1])[0]


@pytest.mark.parametrize("eos_token", ["<|endoftext|>", {"__type": "AddedToken", "content": "<|endoftext|>"}])
@pytest.mark.parametrize("as_file", [False, True])
def test_gpt2_style_folder_ends_lines_with_its_eos(tmp_path, sample, eos_token, as_file):
    folder = make_tokenizer(tmp_path / "gpt2", sample, ["<|endoftext|>"], eos_token=eos_token)
    data = load(sample, folder / "tokenizer.json" if as_file else folder)
    tok, reference = data.tokenizer, Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.kind == "pretrained" and f"({tok.kind})" in data.describe()
    assert data.vocab_size == reference.get_vocab_size(with_added_tokens=True) == 600
    assert tok.eos_id == reference.token_to_id("<|endoftext|>")
    check_lines(data, sample, tok.eos_id)
    text = "Ünïcode, numbers 1 @,@ 200 and <unk> text"
    assert tok.decode(tok.encode_batch([text])[0]) == text


@pytest.mark.parametrize("eos,bos", [("</s>", "<s>"), ("<|end_of_text|>", "<|begin_of_text|>")])
def test_llama_style_eos_from_known_names_and_no_bos_per_line(tmp_path, sample, eos, bos):
    folder = make_tokenizer(tmp_path / "llama", sample, [bos, eos], bos=bos)
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos_id = reference.token_to_id(bos)
    assert reference.encode("the town").ids[0] == bos_id  # the file's own post-processor adds a BOS...
    data = load(sample, folder)
    assert data.tokenizer.eos_id == reference.token_to_id(eos)
    for split in wt.SPLITS:  # ...which the corpus never gets
        assert bos_id not in np.asarray(getattr(data, split))
    check_lines(data, sample, data.tokenizer.eos_id)


def test_config_eos_wins_then_known_names_in_order(tmp_path, sample):
    both = make_tokenizer(tmp_path / "both", sample, ["</s>", "<|endoftext|>", "<|im_end|>"])
    tok = PretrainedTokenizer.load(str(both))
    assert tok.eos_token == "<|endoftext|>"  # GPT-2's name comes before Llama 2's
    (both / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}), encoding="utf-8")
    chat = PretrainedTokenizer.load(str(both))
    assert chat.eos_token == "<|im_end|>" and chat.eos_id == chat.tokenizer.token_to_id("<|im_end|>")
    assert chat.fingerprint != tok.fingerprint  # another end token: other ids, other caches


def test_vocab_counts_added_tokens(tmp_path, sample):
    folder = make_tokenizer(tmp_path / "added", sample, ["<|endoftext|>"])
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>"])
    reference.save(str(folder / "tokenizer.json"))
    tok = PretrainedTokenizer.load(str(folder))
    assert tok.vocab_size == 602 == max(tok.tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def test_id_caches_are_keyed_by_the_tokenizer_file(tmp_path, sample, monkeypatch):
    small = make_tokenizer(tmp_path / "small", sample, ["<|endoftext|>"], eos_token="<|endoftext|>")
    large = make_tokenizer(tmp_path / "large", sample, ["<|endoftext|>"], eos_token="<|endoftext|>", vocab_size=700)
    a, b = load(sample, small), load(sample, large)
    assert a.tokenizer.fingerprint != b.tokenizer.fingerprint
    for data in (a, b):
        caches = sorted(sample.glob(f"*.tokenizer-pretrained-{data.tokenizer.fingerprint}.npy"))
        assert [p.name.split("-")[0] for p in caches] == ["test", "train", "valid"]
    assert len(a.train) > len(b.train)  # the larger vocabulary needs fewer tokens
    assert not list(sample.glob("tokenizer-pretrained*.json"))  # nothing trained, nothing cached as tokenizer

    def forbidden(*args, **kwargs):
        raise AssertionError("re-encoded a cached split")
    monkeypatch.setattr(wt, "encode_lines", forbidden)
    np.testing.assert_array_equal(load(sample, small).train, a.train)


def error_of(fn) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        fn()
    assert err.value.setting == "data.tokenizer" and "\n" not in str(err.value)
    return err.value


def test_missing_path_or_file_fails_at_config_time(tmp_path):
    assert "neither word, bpe nor an existing path" in error_of(
        lambda: WikiTextConfig(sample=True, tokenizer=str(tmp_path / "nowhere"))).what
    (tmp_path / "empty").mkdir()
    assert "no tokenizer.json" in error_of(lambda: WikiTextConfig(sample=True, tokenizer=str(tmp_path / "empty"))).what


@pytest.mark.parametrize("case", ["unreadable", "no_eos", "eos_not_in_vocab", "bad_config"])
def test_bad_tokenizer_files_fail_at_load(tmp_path, sample, case):
    folder = make_tokenizer(tmp_path / case, sample, ["<pad>"] if case == "no_eos" else ["<|endoftext|>"])
    if case == "unreadable":
        (folder / "tokenizer.json").write_text('{"model": "not a tokenizer"}', encoding="utf-8")
    if case == "eos_not_in_vocab":
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    if case == "bad_config":
        (folder / "tokenizer_config.json").write_text("{eos_token: ", encoding="utf-8")
    cfg = WikiTextConfig(root=str(sample), sample=True, tokenizer=str(folder))  # exists: accepted here
    what = error_of(lambda: load_wikitext(cfg)).what
    assert {"unreadable": "cannot read", "no_eos": "<|endoftext|>", "eos_not_in_vocab": "'</s>'",
            "bad_config": "tokenizer_config.json"}[case] in what


def test_command_line_names_the_setting(tmp_path, corpus_root):
    code, _, err = run_main("train.py", *TINY_GPT, *QUIET, f"data.root={corpus_root}", f"run.dir={tmp_path}",
                            f"data.tokenizer={tmp_path / 'no-such-model'}")
    assert code == 2 and err.startswith("error: ") and "(data.tokenizer)" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_train_with_a_tokenizer_folder(tmp_path, sample):
    folder = make_tokenizer(tmp_path / "gpt2", sample, ["<|endoftext|>"], eos_token="<|endoftext|>")
    proc = run_entry("train.py", *TINY_GPT, *QUIET, f"data.root={sample}", f"run.dir={tmp_path / 'run'}",
                     f"data.tokenizer={folder}", "trainer.max_steps=3", "data.limit_eval_tokens=2048")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(pretrained): vocab 600" in proc.stdout and "padded from 600 to 640" in proc.stdout, proc.stdout[-3000:]
