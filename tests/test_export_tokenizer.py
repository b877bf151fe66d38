"""The tokenizer export-hf writes beside the model (utils/language/data/tokenizers.py `hf_files`), for every tokenizer a
language run trains with: the word vocabulary, the BPE, a Hugging Face tokenizer folder (tests/test_hf.py's
workflow) and the copy beside token shards.

Tiny runs (2 steps) of each kind are exported; transformers' AutoTokenizer reads the folder to the ids of the
run's own tokenizer (unknown words, newlines, literal end tokens, odd white space), its special tokens are the
project's (<eos> the end, <unk> the unknown one, no beginning or padding token) and config.json says the same;
utils.evaluate counts the bytes of each token as for the run; transformers' greedy `generate` gives
utils.generate's tokens, and `python -m utils.generate` prints the same text from the folder as from the
checkpoint. The run's cached word or BPE file given as --tokenizer exports as the run's own; a tokenizer of
another vocabulary is refused in one line before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import corpus_lines, make_tokenizer, run_main
from utils.cli.config import load_config
from utils.cli.runs import run_digest
from utils.engine.build import build_run
from utils.language.data.token_bytes import token_bytes
from utils.language.data.tokenizers import BPETokenizer, PretrainedTokenizer, WordTokenizer

transformers = pytest.importorskip("transformers")

# Known and unknown words, a literal <unk> and <eos> (whole words: their ids), "<eos>" inside a word (one unknown
# word), newlines, a tab, a no-break space and a file separator (white space to str.split).
TEXT = ("The game was released in Japan , zzyzx qwerty <unk> . \nIt <eos> was\n\nx<eos>y \tthe\u00a0first\x1cseason "
        "of the year")
PROMPT = "The game was released in"


def train_and_export(run_dir: Path, *overrides: str) -> tuple[Path, Path, object]:
    """A run trained 2 steps and saved, exported with export-hf: (its step folder, the folder, the run's data
    config)."""
    cfg, choices, yaml = load_config([f"run.dir={run_dir}", "trainer.num_workers=0", "trainer.max_steps=10",
                                      "data.seq_len=32", "trainer.global_batch_size=4", *overrides])
    trainer = build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))
    batches = iter(trainer.loaders.train)
    for _ in range(2):
        trainer.train_step(*next(batches))
        trainer.step += 1
    step = trainer.save_checkpoint()
    code, out, err = run_main("utils.export.convert", "export-hf", str(step), str(run_dir / "hf"))
    assert code == 0, err
    assert "AutoTokenizer.from_pretrained" in out
    return step, run_dir / "hf", cfg.data


@pytest.fixture(scope="module", params=[("word", "gpt"), ("bpe", "llama")], ids=["word_gpt", "bpe_llama"])
def exported(request, tmp_path_factory, corpus_root):
    kind, arch = request.param
    run_dir = tmp_path_factory.mktemp(f"export_{kind}") / "run"
    step, folder, data = train_and_export(run_dir, f"model={arch}_tiny", "data=wikitext_sample",
                                          f"data.root={corpus_root}", f"data.tokenizer={kind}")
    tokenizer = (WordTokenizer if kind == "word" else BPETokenizer).load(cached_file(corpus_root, kind))
    return kind, step, folder, tokenizer


def test_transformers_reads_the_run_s_tokenizer(exported):
    kind, _, folder, tokenizer = exported
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json"}
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    want = tokenizer.encode_batch([TEXT])[0]
    assert theirs(TEXT)["input_ids"] == want
    # <eos> is a whole word to the word tokenizer ("x<eos>y" is unknown), a special token inside words to the BPE
    assert want.count(tokenizer.eos_id) == (1 if kind == "word" else 2)
    assert kind == "bpe" or want.count(tokenizer.unk_id) >= 4
    assert (theirs.eos_token, theirs.unk_token, theirs.bos_token, theirs.pad_token) == ("<eos>", "<unk>", None, None)
    assert theirs.eos_token_id == tokenizer.eos_id
    config = json.loads((folder / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (tokenizer.eos_id, None, None)
    ours = PretrainedTokenizer.load(str(folder))  # how utils.generate and utils.evaluate read the folder
    assert ours.eos_id == tokenizer.eos_id and ours.vocab_size == tokenizer.vocab_size == config["vocab_size"]
    assert ours.encode_batch([TEXT]) == [want]
    text = want + [tokenizer.eos_id] + want[:5]
    assert ours.decode(text) == tokenizer.decode(text)
    assert (token_bytes(ours) == token_bytes(tokenizer)).all()  # utils.evaluate's bits per byte: the run's


def test_transformers_greedy_generation_equals_utils_generate(exported):
    from utils.generate.command import load
    from utils.language.task.sampling import Sampling, sample

    _, step, folder, tokenizer = exported
    prompt = tokenizer.encode_batch([PROMPT])[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    source = load(SimpleNamespace(source=folder, data=[], tokenizer=None, device="cpu"))[0]  # `utils.generate FOLDER`
    assert source.eos_id == tokenizer.eos_id
    ours = sample(source.model, [prompt], 12, Sampling(temperature=0.0), eos_id=source.eos_id)[0]
    assert ours == theirs and len(theirs) >= 1
    printed = []
    for src in (folder, step):
        code, out, err = run_main("utils.generate.command", str(src), "--prompt", PROMPT, "--temperature", "0",
                                  "--max-new-tokens", "12", "--device", "cpu")
        assert code == 0, err
        printed.append(out)
    text = tokenizer.decode(prompt + (theirs[:-1] if theirs[-1] == tokenizer.eos_id else theirs))
    assert printed == [text + "\n"] * 2


def cached_file(corpus_root: Path, kind: str) -> Path:
    """The run's tokenizer as the corpus's cache holds it (tokenizer-word-*.json, tokenizer-bpe<N>-*.json)."""
    from utils.data.cache import cache_folders
    from utils.language.data.wikitext import load_tokenizer, locate

    data = load_config(["model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}",
                        f"data.tokenizer={kind}"])[0].data
    folder, sources = locate(data)
    name = load_tokenizer(data, sources["train"], cache_folders(folder, data.cache_dir))[1]
    return next(f / f"{name}.json" for f in cache_folders(folder, data.cache_dir) if (f / f"{name}.json").is_file())


def test_the_cached_file_as_tokenizer_exports_as_the_run_s_own(exported, corpus_root, tmp_path):
    kind, step, folder, _ = exported
    out = tmp_path / "out"
    code, _, err = run_main("utils.export.convert", "export-hf", str(step), str(out), "--tokenizer",
                            str(cached_file(corpus_root, kind)))
    assert code == 0, err
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name


def test_a_tokenizer_of_another_vocabulary_is_refused_before_writing(exported, corpus_root, tmp_path):
    _, step, _, tokenizer = exported
    other = make_tokenizer(tmp_path / "other", corpus_root, ["<|endoftext|>"], vocab_size=300)
    for given, needle in ((other, f"the tokenizer has 300 tokens, the run's model {tokenizer.vocab_size}"),
                          (tmp_path / "missing", "is neither word, bpe nor an existing path")):
        code, _, err = run_main("utils.export.convert", "export-hf", str(step), str(tmp_path / "out"),
                                "--tokenizer", str(given))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
        assert needle in lines[0] and "(--tokenizer)" in lines[0], lines[0]
        assert not (tmp_path / "out").exists()


def test_the_word_vocabulary_as_a_hf_tokenizer_splits_as_str_split(corpus_root):
    """Every character str.split splits at (the separators U+001C..U+001F too, which Rust's white space lacks)
    splits the Hugging Face word tokenizer, and none else."""
    tokenizer = WordTokenizer.train(corpus_lines(corpus_root, "train"))
    hf = tokenizer.to_hf()
    spaces = [chr(c) for c in range(0x3100) if chr(c).isspace()]
    others = ["\u200b", "\u2060", "\ufeff", "\x00", "-", "'"]
    text = " ".join(f"The{c}game{c}zzyzx" for c in spaces + others)
    assert hf.encode(text).ids == tokenizer.encode_batch([text])[0]
    assert len(tokenizer.encode_batch([text])[0]) == 3 * len(spaces) + len(others)


def test_shards_prepared_with_the_project_s_bpe_export_its_tokenizer(corpus_root, tmp_path):
    """prepare accepts the project's cached BPE file (its end token is <eos>); a data=tokens run on those shards
    exports the copy beside them, with a tokenizer_config.json naming <eos> and <unk>."""
    from utils.language.data.tokenizers import hf_files

    bpe = cached_file(corpus_root, "bpe")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.txt").write_text("\n\n".join(corpus_lines(corpus_root, "train")[:300]) + "\n")
    code, _, err = run_main("utils.language.data.prepare", str(tmp_path / "in"), "--tokenizer", str(bpe), "--out",
                            str(tmp_path / "shards"))
    assert code == 0, err
    _, folder, _ = train_and_export(tmp_path / "run", "model=gpt_tiny", "data=tokens",
                                    f"data.root={tmp_path / 'shards'}", "data.valid_fraction=0.1")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = BPETokenizer.load(bpe)
    assert theirs(TEXT)["input_ids"] == ours.encode_batch([TEXT])[0]
    assert (theirs.eos_token, theirs.unk_token, theirs.eos_token_id) == ("<eos>", "<unk>", ours.eos_id)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == ours.eos_id
    assert (folder / "tokenizer.json").read_bytes() == bpe.read_bytes()
    assert hf_files(ours)["tokenizer_config.json"] == (folder / "tokenizer_config.json").read_bytes()
