"""Pre-tokenized shards: `python -m utils.data.prepare` writes them, `data=tokens` reads them by memory map.

The corpus is documents taken from the sample corpus' lines, the tokenizer a tiny byte-level BPE in the Hugging
Face layout (tests/helpers.make_tokenizer). The reader is checked against the WikiText reader on the same text
(equal token streams, rows and batches), the order of batches across dp sizes and resumption, and its
resident memory on shards several times larger than the bound, measured in a process without torch.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from networks.documents import DOC_START
from tests.helpers import QUIET, ROOT, corpus_lines, make_tokenizer, read_scalars, run_entry, run_main
from utils import ConfigError
from utils.data.batching import GlobalBatchSampler, build_loaders
from utils.language.data.shards import ShardStream, ShardWriter, read_index
from utils.language.data.tokenizers import PretrainedTokenizer
from utils.language.data.tokens import TokensConfig, load_tokens
from utils.language.data.wikitext import WikiTextConfig, load_wikitext

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def lines(corpus_root) -> list[str]:
    return corpus_lines(corpus_root, "train")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus_root) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "gpt2ish", corpus_root, [EOS])


def write_inputs(folder: Path, lines: list[str]) -> dict[str, list[str]]:
    """A text file (blank-line blocks, some of several lines, a byte-order mark), a parquet file and arrow files
    in both IPC formats; returns each file's documents as prepare must read them."""
    folder.mkdir(parents=True, exist_ok=True)
    text_docs = [lines[i] if i % 3 else f"{lines[i]}\n  {lines[i + 1]}" for i in range(0, 60, 2)]
    (folder / "a.txt").write_text("\n\n\n".join(text_docs) + "\n", encoding="utf-8-sig")  # with a byte-order mark
    rows = lines[60:100]
    table = pa.table({"id": list(range(len(rows) + 2)), "text": rows[:20] + [None, "  "] + rows[20:]})
    pq.write_table(table, folder / "b.parquet", row_group_size=7)
    arrow = pa.table({"text": lines[100:130]})
    with pa.OSFile(str(folder / "c.arrow"), "wb") as sink, pa.ipc.new_stream(sink, arrow.schema) as writer:
        writer.write_table(arrow, max_chunksize=8)  # what `datasets` writes: the IPC stream format
    with pa.OSFile(str(folder / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, arrow.schema) as writer:
        writer.write_table(pa.table({"text": lines[130:140]}))
    return {"a.txt": [d.strip() for d in text_docs], "b.parquet": [r.strip() for r in rows],
            "c.arrow": lines[100:130], "d.arrow": lines[130:140]}


def prepare(inputs: list[Path | str], tokenizer: Path, out: Path, *extra: str) -> str:
    code, stdout, stderr = run_main("utils.language.data.prepare", *map(str, inputs), "--tokenizer", str(tokenizer),
                                    "--out", str(out), *extra)
    assert code == 0, stderr
    return stdout


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, lines, tokenizer) -> tuple[Path, dict[str, list[str]]]:
    base = tmp_path_factory.mktemp("prepared")
    docs = write_inputs(base / "in", lines)
    prepare([base / "in"], tokenizer, base / "out")
    return base, docs


def test_shards_hold_each_document_then_eos(prepared, tokenizer):
    base, docs = prepared
    index, tok = read_index(base / "out"), PretrainedTokenizer.load(str(tokenizer))
    assert index.tokenizer["vocab_size"] == tok.vocab_size == 600 and index.tokenizer["eos_id"] == tok.eos_id
    assert [Path(s["source"]).name for s in index.shards] == list(docs)  # a folder's files in name order
    for i, shard in enumerate(index.shards):
        expected = [ids + [tok.eos_id] for ids in tok.encode_batch(docs[Path(shard["source"]).name])]
        tokens = np.fromfile(index.path(i), dtype=np.uint16)
        assert shard["dtype"] == "uint16" and shard["num_documents"] == len(expected)
        assert tokens.tolist() == sum(expected, [])
        starts = np.load(index.path(i, "documents_file"))
        assert starts.tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist()
    assert tok.decode(tok.encode_batch([docs["a.txt"][0]])[0]) == docs["a.txt"][0]  # the block's two lines
    assert "\n" in docs["a.txt"][0] and (base / "out" / "tokenizer" / "tokenizer.json").is_file()


def test_validation_holds_the_last_documents_of_each_shard(prepared):
    base, docs = prepared
    corpus = load_tokens(TokensConfig(root=str(base / "out"), valid_fraction=0.1, seq_len=8))
    index, held = corpus.index, [3, 4, 3, 1]  # floor(0.1 x documents so far) per shard: 30, 40, 30, 10 documents
    train, valid = [], []
    for i, n in enumerate(held):
        tokens, starts = np.fromfile(index.path(i), dtype=np.uint16), np.load(index.path(i, "documents_file"))
        cut = starts[len(starts) - 1 - n]
        train.append(tokens[:cut])
        valid.append(tokens[cut:])
    assert np.array_equal(corpus.train[:], np.concatenate(train))
    assert np.array_equal(corpus.valid[:], np.concatenate(valid))
    assert np.array_equal(corpus.train[40:2000], np.concatenate(train)[40:2000])  # a read across shards
    assert corpus.vocab_size == 600 and "4 shards" in corpus.describe()


def test_rerun_keeps_good_shards_and_redoes_damaged_ones(prepared, tokenizer, tmp_path):
    base, _ = prepared
    out = tmp_path / "out"
    shutil.copytree(base / "out", out)
    before = json.loads((out / "index.json").read_text())
    assert prepare([base / "in"], tokenizer, out).count("(kept: checksums match)") == 4
    damaged = bytearray((out / "00001.tokens").read_bytes())
    damaged[10] ^= 1
    (out / "00001.tokens").write_bytes(bytes(damaged))
    (out / "00002.json").unlink()  # interrupted before its record: redone
    (out / ".00003.tokens.999.tmp").write_bytes(b"half a shard")  # an interrupted write's leftover: ignored
    stdout = prepare([base / "in"], tokenizer, out)
    assert stdout.count("(kept: checksums match)") == 2 and "00001 <-" in stdout and "00002 <-" in stdout
    assert json.loads((out / "index.json").read_text()) == before


def test_parallel_workers_write_the_same_shards(prepared, tokenizer, tmp_path):
    base, _ = prepared
    prepare([base / "in"], tokenizer, tmp_path / "par", "--workers", "2")
    checksums = [[s["sha256"] for s in read_index(folder).shards] for folder in (base / "out", tmp_path / "par")]
    assert checksums[0] == checksums[1]


def test_large_vocabularies_get_uint32(tmp_path):
    writer = ShardWriter(tmp_path, 0, "uint32", eos_id=70_000)
    writer.add([[1, 65_536, 99_999], [], [5]])
    record = writer.finish({})
    assert record["dtype"] == "uint32" and record["num_documents"] == 2
    stream = ShardStream([tmp_path / record["tokens_file"]], ["uint32"], np.array([[0, 0, 6]]))
    assert stream[0:6].tolist() == [1, 65_536, 99_999, 70_000, 5, 70_000]


def reader_error(root: Path, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_tokens(TokensConfig(root=str(root), **kw))
    assert info.value.setting == "data.root"
    return info.value


def test_reader_refuses_missing_corrupt_or_damaged_shards(prepared, tmp_path):
    base, _ = prepared
    assert "holds no index.json" in str(reader_error(tmp_path))
    out = tmp_path / "out"
    shutil.copytree(base / "out", out)
    damaged = bytearray((out / "00002.tokens").read_bytes())
    damaged[0] ^= 1
    (out / "00002.tokens").write_bytes(bytes(damaged))
    assert "checksum of" in str(reader_error(out))
    load_tokens(TokensConfig(root=str(out), verify="size"))  # sizes only: the flipped bit passes
    (out / "00002.tokens").write_bytes(bytes(damaged[:-2]))
    assert "the index says" in str(reader_error(out, verify="size"))
    shutil.copy(base / "out" / "00002.tokens", out / "00002.tokens")
    (out / "00000.docs.npy").write_bytes((out / "00000.docs.npy").read_bytes()[:-8])
    assert "document starts of 00000.tokens" in str(reader_error(out, verify="size"))
    (out / "index.json").write_text('{"format": "dlscale-tokens", "version": 1, "shards": [')
    assert "cannot read" in str(reader_error(out))


@pytest.mark.parametrize("argv,setting", [
    (["missing.txt"], "INPUT"), (["bad/x.csv"], "INPUT"), (["in/b.parquet", "--text-field", "body"], "--text-field"),
    (["in/b.parquet", "--text-field", "id"], "--text-field"), (["in/a.txt", "--workers", "0"], "--workers"),
    (["bad/empty.txt"], "INPUT"), (["in/a.txt", "in/../in/a.txt"], "INPUT")])
def test_prepare_bad_input_is_one_line(prepared, tokenizer, argv, setting, monkeypatch):
    base, _ = prepared
    (base / "bad").mkdir(exist_ok=True)
    (base / "bad" / "x.csv").write_text("a,b\n")
    (base / "bad" / "empty.txt").write_text("\n\n")
    monkeypatch.chdir(base)
    code, _, err = run_main("utils.language.data.prepare", *argv, "--tokenizer", str(tokenizer), "--out",
                            str(base / "bad_out"))
    assert code == 2 and err.startswith("error: ") and f"({setting})" in err and err.count("\n") == 1, err
    code, _, err = run_main("utils.language.data.prepare", "in/a.txt", "--tokenizer", str(base), "--out",
                            str(base / "bad_out"))
    assert code == 2 and "(--tokenizer)" in err


@pytest.fixture(scope="module")
def twins(tmp_path_factory, lines, tokenizer) -> tuple:
    """The same 100 one-line documents as WikiText files (90 train, 10 valid) and as shards (valid_fraction 0.1)."""
    base = tmp_path_factory.mktemp("twins")
    docs = lines[200:300]
    (base / "wiki").mkdir()
    for split, part in (("train", docs[:90]), ("valid", docs[90:]), ("test", docs[90:])):
        (base / "wiki" / f"wiki.{split}.tokens").write_text("\n".join(part) + "\n", encoding="utf-8")
    (base / "docs.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    prepare([base / "docs.txt"], tokenizer, base / "shards")
    wikitext = load_wikitext(WikiTextConfig(root=str(base / "wiki"), tokenizer=str(tokenizer)))
    return base, wikitext, load_tokens(TokensConfig(root=str(base / "shards"), valid_fraction=0.1, seq_len=16))


def test_reader_serves_what_the_wikitext_reader_serves(twins):
    _, wikitext, tokens = twins
    assert tokens.vocab_size == wikitext.vocab_size and tokens.unigram_ppl == pytest.approx(wikitext.unigram_ppl)
    for split in ("train", "valid"):
        assert np.array_equal(getattr(tokens, split)[:], np.asarray(getattr(wikitext, split)))
        ours, theirs = tokens.dataset(split, 16), wikitext.dataset(split, 16)
        assert len(ours) == len(theirs) > 4
        for i in range(len(ours)):
            assert all(a.equal(b) for a, b in zip(ours[i], theirs[i]))
    copy = pickle.loads(pickle.dumps(ours))  # as data-loader workers get it: after reads, without the mappings
    assert not copy.tokens.maps and ours.tokens.maps and all(a.equal(b) for a, b in zip(copy[3], theirs[3]))


def test_packed_rows_flag_the_documents_the_wikitext_reader_flags(lines, tokenizer, tmp_path):
    """data.packing=documents: 120 one-line articles (title lines) in three files; WikiText's packing makes each
    its own document, so both readers must flag the same starts, across shards and the held-out documents."""
    docs = [f"= {line} =" for line in lines[300:500] if not line.startswith("=")][:120]
    files = [docs[i:i + 40] for i in range(0, 120, 40)]  # 4 of each 40 held out at valid_fraction 0.1
    for i, part in enumerate(files):
        (tmp_path / f"{i}.txt").write_text("\n\n".join(part) + "\n", encoding="utf-8")
    (tmp_path / "wiki").mkdir()
    for split, part in (("train", sum((f[:36] for f in files), [])), ("valid", sum((f[36:] for f in files), [])),
                        ("test", files[0][36:])):
        (tmp_path / "wiki" / f"wiki.{split}.tokens").write_text("\n".join(part) + "\n", encoding="utf-8")
    prepare([tmp_path / f"{i}.txt" for i in range(3)], tokenizer, tmp_path / "shards")
    packed = {"packing": "documents", "attention": "document"}
    wikitext = load_wikitext(WikiTextConfig(root=str(tmp_path / "wiki"), tokenizer=str(tokenizer), **packed))
    tokens = load_tokens(TokensConfig(root=str(tmp_path / "shards"), valid_fraction=0.1, **packed))
    for split, num_docs in (("train", 108), ("valid", 12)):
        ours, theirs = tokens.dataset(split, 16), wikitext.dataset(split, 16)
        assert len(ours) == len(theirs) > 8
        assert sum(int((ours[i][0] >= DOC_START).sum()) for i in range(len(ours))) == num_docs  # a flag each
        for i in range(len(ours)):
            assert all(a.equal(b) for a, b in zip(ours[i], theirs[i])), (split, i)


def batches(dataset, dp_rank: int, dp: int, start_step: int, steps: int) -> list:
    loaders = build_loaders(dataset, dataset, global_batch_size=64, dp_rank=dp_rank, dp_size=dp, seed=5,
                            start_step=start_step, num_workers=0, pin_memory=False)
    it = iter(loaders.train)
    return [next(it)[0] for _ in range(steps)]


def test_batches_are_the_same_for_any_dp_and_resume_mid_epoch(twins):
    _, _, tokens = twins
    dataset = tokens.dataset("train", 16)
    assert GlobalBatchSampler(len(dataset), 64, 0, 1, seed=5).steps_per_epoch < 6  # six steps cross an epoch
    serial = batches(dataset, 0, 1, 0, 6)
    halves = [batches(dataset, r, 2, 0, 6) for r in range(2)]
    for step in range(6):
        assert serial[step].equal(torch.cat([halves[0][step], halves[1][step]]))
    resumed = batches(dataset, 1, 2, 3, 3)  # resumed mid-run with the other layout
    assert all(a.equal(b) for a, b in zip(resumed, halves[1][3:]))


MEMORY_SCRIPT = """
import sys
import numpy as np
from pathlib import Path
from utils.language.data.shards import ShardStream, check_shards, held_out_split, read_index
index = read_index(Path(sys.argv[1]))
check_shards(index, checksum=True)
train, valid = held_out_split(index, 0.01)
files, dtypes = [index.path(i) for i in range(len(index.shards))], ["uint16"] * len(index.shards)
stream = ShardStream(files, dtypes, train, resident_bytes=int(sys.argv[2]) << 20)
rows, total = (len(stream) - 1) // 16384, 0
for r in np.random.default_rng(0).permutation(rows):
    total += int(stream[r * 16384:r * 16384 + 16385][-1])
assert "torch" not in sys.modules
peak_kib = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])  # this program's, not the forking one's
print(rows, peak_kib // 1024)
"""


def test_resident_memory_stays_bounded_on_larger_shards(tmp_path):
    """Two shards of 100 MB each (uint16), every row of 16385 tokens read in random order with a bound of 16 MiB:
    the peak resident set of a process holding the reader alone (no torch) stays under 60 MB, under a third of
    the shards (without the bound it reaches the shards' 200 MB and more)."""
    for number in range(2):
        writer = ShardWriter(tmp_path, number, "uint16", eos_id=0)
        ids = np.arange(1 << 20, dtype=np.uint16)
        for _ in range(50):  # 50 documents of 1 Mi tokens: 100 MB
            writer.add_ids(ids, np.array([1 << 20]))
        writer.finish({})
    records = [json.loads((tmp_path / f"0000{i}.json").read_text()) for i in range(2)]
    index = {"format": "dlscale-tokens", "version": 1, "shards": records,
             "tokenizer": {"vocab_size": 1 << 16, "eos_id": 0, "fingerprint": "none"}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(MEMORY_SCRIPT), str(tmp_path), "16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    for record in records:
        (tmp_path / record["tokens_file"]).unlink()
    assert proc.returncode == 0, proc.stderr
    rows, peak_mib = map(int, proc.stdout.split())
    assert rows > 6000 and peak_mib < 60, (rows, peak_mib)


@pytest.mark.slow
def test_train_py_on_shards_equals_the_wikitext_run(twins, tokenizer, tmp_path):
    """train.py with data=tokens trains exactly as data=wikitext does on the same text and tokenizer: the
    preset composes, the rows and their order are the WikiText reader's, so the loss curves are equal; and
    utils.generate samples from the run's checkpoint with the tokenizer copied beside the shards."""
    base, _, _ = twins
    common = ["model=gpt_tiny", "data.seq_len=16", "data.sample_tokens=0", "trainer.global_batch_size=8",
              "model.embed_dim=64", *QUIET, "trainer.log_every=1", "trainer.max_steps=4"]
    curves = []
    for name, data in (("tokens", ["data=tokens", f"data.root={base / 'shards'}", "data.valid_fraction=0.1"]),
                       ("wikitext", ["data=wikitext", f"data.root={base / 'wiki'}", f"data.tokenizer={tokenizer}"])):
        proc = run_entry("train.py", *common, *data, f"run.dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves.append([v for _, v in read_scalars(tmp_path / name)["train/loss"]])
    assert len(curves[0]) == 4 and all(np.isfinite(curves[0])) and curves[0] == curves[1], curves
    checkpoint = tmp_path / "tokens" / "checkpoints" / "step_0000004"  # sampled with the shards' tokenizer copy
    code, out, err = run_main("utils.generate.command", str(checkpoint), "--prompt", "The town", "--max-new-tokens=3")
    assert code == 0 and out.startswith("The town"), err


@pytest.mark.parametrize("args,setting", [(["data.root=/nonexistent"], "data.root"),
                                          (["data.valid_fraction=1.5"], "data.valid_fraction"),
                                          (["data.verify=never"], "data.verify"),
                                          (["data.attention=document"], "data.attention")])
def test_train_py_refuses_bad_token_settings(args, setting, tmp_path):
    code, _, err = run_main("train.py", "model=gpt_tiny", "data=tokens", f"run.dir={tmp_path}", *args)
    assert code == 2 and err.startswith("error: ") and f"({setting})" in err and "Traceback" not in err, err
