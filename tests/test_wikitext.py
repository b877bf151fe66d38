"""WikiText readers, tokenizers, caches, block dataset, unigram baseline, errors, and the sample corpus."""

import filecmp
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from utils import ConfigError
from utils.data import cache as data_cache
from utils.language.data import corpus
from utils.language.data import wikitext as wt
from utils.language.data.wikitext import LMBlockDataset, WikiTextConfig, load_wikitext, unigram_perplexity

TRAIN = [" ", " = Valid Heading = ", " ", " the cat sat on the mat . ", " ", " the dog sat on a <unk> . ",
         " = = Section = = ", " a cat and a dog , 1 @,@ 200 in all . "] * 4
VALID = [" ", " the cat sat . ", " ", " a dog sat on the mat . "] * 3
TEST = [" the mat sat on a cat . ", " ", " the dog . "] * 3
LINES = {"train": TRAIN, "valid": VALID, "test": TEST}


def write_text(folder: Path, ext: str = "tokens", lines: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, content in (lines or LINES).items():
        (folder / f"wiki.{split}.{ext}").write_text("\n".join(content) + "\n", encoding="utf-8")
    return folder


def write_parquet(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, hf in wt.HF_SPLITS.items():  # HF rows keep their newline; blank rows are ""
        rows = [line + "\n" if line.strip() else "" for line in LINES[split]]
        pq.write_table(pa.table({"text": rows}), folder / f"{hf}-00000-of-00001.parquet")
    return folder


def nonblank(lines):
    return [line.strip() for line in lines if line.strip()]


def load(root: Path, **kw):
    return load_wikitext(WikiTextConfig(root=str(root), seq_len=kw.pop("seq_len", 4), **kw))


def test_word_tokenizer_reads_distributed_files(tmp_path):
    data = load(write_text(tmp_path / "wikitext-2").parent)
    assert data.folder == tmp_path / "wikitext-2"
    tok = data.tokenizer
    assert tok.words[:2] == ["<unk>", "<eos>"] and tok.kind == "word"
    assert tok.vocab_size == len(set(" ".join(TRAIN).split()) | {"<unk>", "<eos>"})
    # One <eos> per non-blank line (blank lines are skipped), words in file order.
    assert int((np.asarray(data.train) == tok.eos_id).sum()) == len(nonblank(TRAIN))
    assert tok.decode(data.train).split("\n")[:-1] == nonblank(TRAIN)
    assert data.train.dtype == np.int32 and len(data.valid) == sum(len(s.split()) + 1 for s in nonblank(VALID))
    assert "unigram valid ppl" in data.describe()


def test_raw_files_and_unknown_words(tmp_path):
    lines = dict(LINES, valid=[" zebra sat on the mat . "])
    data = load(write_text(tmp_path / "wikitext-103-raw", "raw", lines).parent, raw=True, variant="wikitext-103")
    assert data.folder.name == "wikitext-103-raw"
    assert data.tokenizer.decode(data.valid) == "<unk> sat on the mat .\n"


def test_parquet_layout_matches_text_files(tmp_path):
    parquet = load(write_parquet(tmp_path / "hf" / "wikitext-2-raw-v1").parent, raw=True)
    text = load(write_text(tmp_path / "txt"))
    assert parquet.folder.name == "wikitext-2-raw-v1"
    assert parquet.tokenizer.words == text.tokenizer.words
    for split in wt.SPLITS:
        np.testing.assert_array_equal(getattr(parquet, split), getattr(text, split))


def test_bpe_trains_on_train_and_round_trips(tmp_path):
    data = load(write_text(tmp_path), tokenizer="bpe", bpe_vocab_size=300)
    tok = data.tokenizer
    assert tok.kind == "bpe" and 256 < tok.vocab_size <= 300
    assert tok.decode(data.train) == "".join(line + "\n" for line in nonblank(TRAIN))
    assert tok.decode(data.test) == "".join(line + "\n" for line in nonblank(TEST))
    train_fingerprint = wt.SplitSource((tmp_path / "wiki.train.tokens",)).fingerprint()
    assert (tmp_path / f"tokenizer-bpe300-{train_fingerprint}.json").is_file()
    text = "Ünïcode and <unk> text the cat"
    assert tok.decode(tok.encode_batch([text])[0]) == text


@pytest.mark.parametrize("tokenizer", ["word", "bpe"])
def test_cache_is_reused(tmp_path, monkeypatch, tokenizer):
    write_text(tmp_path)
    first = load(tmp_path, tokenizer=tokenizer, bpe_vocab_size=300)
    caches = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".npy"))
    assert len(caches) == 4  # tokenizer + three splits
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    def forbidden(*args, **kwargs):
        raise AssertionError("rebuilt a cached file")
    monkeypatch.setattr(wt.WordTokenizer, "train", forbidden)
    monkeypatch.setattr(wt.BPETokenizer, "train", forbidden)
    monkeypatch.setattr(wt, "encode_lines", forbidden)
    second = load(tmp_path, tokenizer=tokenizer, bpe_vocab_size=300)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == mtimes
    np.testing.assert_array_equal(first.train, second.train)
    assert second.vocab_size == first.vocab_size


def test_changed_file_or_settings_build_new_caches(tmp_path):
    write_text(tmp_path)
    load(tmp_path)
    write_text(tmp_path, lines=dict(LINES, train=TRAIN + [" new words here . "]))
    data = load(tmp_path)
    assert "new" in data.tokenizer.words
    assert len(list(tmp_path.glob("tokenizer-word-*.json"))) == 2
    assert len(list(tmp_path.glob("train-*.tokenizer-word-*.npy"))) == 2
    for size in (300, 280):
        assert load(tmp_path, tokenizer="bpe", bpe_vocab_size=size).vocab_size <= size
    assert len(list(tmp_path.glob("tokenizer-bpe*.json"))) == 2


def test_read_only_data_folder_uses_cache_dir(tmp_path, monkeypatch):
    data_dir, cache = write_text(tmp_path / "data"), tmp_path / "cache"
    real = data_cache.tempfile.mkstemp

    def mkstemp(dir, **kwargs):
        if Path(dir) == data_dir:
            raise PermissionError(13, "read-only", str(dir))
        return real(dir=dir, **kwargs)
    monkeypatch.setattr(data_cache.tempfile, "mkstemp", mkstemp)
    data = load(data_dir, cache_dir=str(cache))
    assert not list(data_dir.glob("*.npy")) and len(list(cache.rglob("*.npy"))) == 3
    assert data.tokenizer.vocab_size > 2


def test_block_dataset_shifts_targets():
    ds = LMBlockDataset(np.arange(10, dtype=np.int32), seq_len=3)
    assert len(ds) == 3  # 9 targets / 3; the last token is only a target
    x, y = ds[1]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    assert ds[2][1].tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        ds[3]
    assert len(LMBlockDataset(torch.arange(7), seq_len=3)) == 2


def test_unigram_perplexity_known_case():
    # add-one counts [3, 2, 1] / 6: p(0) = 1/2, p(1) = 1/3 -> ppl = (1/2 * 1/3) ** -1/2 = sqrt(6)
    assert math.isclose(unigram_perplexity(np.array([0, 0, 1]), np.array([0, 1]), 3), math.sqrt(6))
    uniform = unigram_perplexity(np.array([], dtype=np.int64), np.arange(5), 5)
    assert math.isclose(uniform, 5.0)


def error_setting(fn) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        fn()
    return err.value


def test_missing_splits_say_what_was_looked_for(tmp_path):
    err = error_setting(lambda: load(tmp_path))
    assert err.setting == "data.root"
    assert "wiki.{train,valid,test}.tokens" in err.what and str(tmp_path / "wikitext-2-v1") in err.what
    write_text(tmp_path, lines={"train": TRAIN})
    err = error_setting(lambda: load(tmp_path))
    assert err.setting == "data.root" and "valid, test" in err.what
    assert error_setting(lambda: load(tmp_path / "nowhere")).setting == "data.root"
    assert error_setting(lambda: load_wikitext(WikiTextConfig(root=None))).setting == "data.root"


@pytest.mark.parametrize("split", ["train", "valid"])
def test_empty_corpus(tmp_path, split):
    write_text(tmp_path, lines=dict(LINES, **{split: [" ", ""]}))
    err = error_setting(lambda: load(tmp_path))
    assert err.setting == "data.root" and "no text" in err.what


def test_parquet_without_text_column(tmp_path):
    write_parquet(tmp_path)
    pq.write_table(pa.table({"body": ["a b c"]}), tmp_path / "train-00000-of-00001.parquet")
    assert "'text'" in error_setting(lambda: load(tmp_path)).what


def test_split_shorter_than_one_block(tmp_path):
    data = load(write_text(tmp_path))
    assert error_setting(lambda: data.dataset("valid", len(data.valid))).setting == "data.seq_len"
    assert len(data.dataset("valid", len(data.valid) - 1)) == 1


@pytest.mark.parametrize("field,value,setting", [
    ("tokenizer", "char", "data.tokenizer"), ("variant", "wikitext-3", "data.variant"),
    ("bpe_vocab_size", 100, "data.bpe_vocab_size"), ("seq_len", 0, "data.seq_len"),
    ("limit_train_tokens", 3, "data.limit_train_tokens"), ("kind", "era5", "data.kind")])
def test_config_errors(field, value, setting):
    args = {"root": "/data", field: value}
    assert error_setting(lambda: WikiTextConfig(**args)).setting == setting


def test_limits_truncate(tmp_path):
    data = load(write_text(tmp_path), limit_train_tokens=20, limit_eval_tokens=10)
    assert (len(data.train), len(data.valid), len(data.test)) == (20, 10, 10)


def test_sample_corpus_is_deterministic_and_learnable(tmp_path):
    a, b = corpus.ensure_sample_corpus(tmp_path / "a"), corpus.ensure_sample_corpus(tmp_path / "b")
    assert sorted(p.name for p in a.iterdir()) == sorted(corpus.FILES)
    assert all(filecmp.cmp(a / name, b / name, shallow=False) for name in corpus.FILES)
    assert corpus.ensure_sample_corpus(a) == a  # present: reused as is
    other = corpus.ensure_sample_corpus(tmp_path / "c", seed=1)
    assert not filecmp.cmp(a / corpus.FILES[0], other / corpus.FILES[0], shallow=False)
    text = (a / "wiki.train.tokens").read_text(encoding="utf-8")
    assert text.startswith(" \n = ") and " = = " in text and " @,@ " in text
    assert 300_000 < len(text.split()) < 600_000
    data = load_wikitext(WikiTextConfig(root=str(a), sample=True))
    v = data.vocab_size
    assert 300 < v < 2000
    # Clear structure: even a bigram model is far better than the unigram baseline.
    train, valid = np.asarray(data.train, np.int64), np.asarray(data.valid, np.int64)
    pairs = np.bincount(train[:-1] * v + train[1:], minlength=v * v).reshape(v, v) + 0.01
    log_p = np.log(pairs / pairs.sum(1, keepdims=True))
    bigram = math.exp(-log_p[valid[:-1], valid[1:]].mean())
    assert bigram < unigram_perplexity(train, valid, v) / 5


def test_sample_corpus_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    err = error_setting(lambda: corpus.ensure_sample_corpus(tmp_path / "x"))
    assert err.setting == "data.root"
    assert error_setting(lambda: WikiTextConfig(sample=True, raw=True)).setting == "data.raw"


def test_sample_corpus_race_keeps_the_winner(tmp_path, monkeypatch):
    target = tmp_path / "sample"

    def racing(folder, seed=0):  # another process finishes first while we generate
        target.mkdir()
        for name in corpus.FILES:
            (target / name).write_text("winner")
        (folder / "wiki.train.tokens").write_text("loser")
    monkeypatch.setattr(corpus, "generate", racing)
    assert corpus.ensure_sample_corpus(target) == target
    assert (target / "wiki.train.tokens").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample"]  # temporary folder removed


def test_cache_race_keeps_the_first_file(tmp_path):
    def racing(tmp: Path):
        (tmp_path / "c.json").write_text("first")
        tmp.write_text("second")
    assert data_cache.cached("c.json", [tmp_path], racing).read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["c.json"]  # no temp files left
    assert data_cache.cached("c.json", [tmp_path], lambda tmp: pytest.fail("rebuilt")).read_text() == "first"
