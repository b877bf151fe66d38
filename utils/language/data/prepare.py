"""`python -m utils.data.prepare INPUT... --tokenizer DIR --out DIR`: text into pre-tokenized shards for `data=tokens`.

Inputs (files, or folders whose files of these kinds are taken in name order):

    *.txt        UTF-8 text; a document is a block of non-blank lines, blocks separated by blank lines (its
                 lines joined by newlines, the block stripped of surrounding white space)
    *.parquet    Hugging Face `datasets` parquet files (the Hub's data/train-00000-of-00001.parquet ...)
    *.arrow      Hugging Face `datasets` arrow files (save_to_disk, the datasets cache: the IPC stream format;
                 the IPC file format is read too); in both, a row's --text-field string is a document

The tokenizer is a Hugging Face tokenizer folder (tokenizer.json, as GPT-2 and Llama ship it) read as
`data.tokenizer=PATH` reads it (utils/language/data/tokenizers.py): its end-of-text token follows every document, no
BOS is added. Input file i becomes shard i (format: utils/language/data/shards.py), one worker process per file at a
time (--workers). A rerun keeps each shard whose record names the same source file (path, size, modification
time), tokenizer and text field and whose checksums match, and redoes the others; a shard is written under a
temporary name and renamed, so an interrupted run leaves no shard that looks finished. Every input is checked
(exists, a known kind, the text field present) before any work; bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from utils import ConfigError, exit_bad_input, require
from utils.language.data.shards import FORMAT, INDEX, VERSION, ShardWriter, dtype_for, replace_atomically, sha256_file
from utils.language.data.tokenizers import PretrainedTokenizer, pretrained_file

KINDS = (".txt", ".parquet", ".arrow")
BATCH = 1024  # documents encoded per call of the tokenizer


@dataclass(frozen=True)
class Job:
    """One input file and the shard it becomes."""

    number: int
    source: str  # the input file, resolved
    out: str
    tokenizer: str  # the tokenizer folder or file
    text_field: str
    dtype: str
    expected: dict  # what the shard's record must say to be kept: source, size, mtime, tokenizer, text field


def text_documents(path: Path) -> Iterator[str]:
    """The blank-line-separated blocks of a text file, stripped."""
    lines: list[str] = []
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is not text
        for line in f:
            if line.strip():
                lines.append(line.rstrip("\n"))
            elif lines:
                yield "\n".join(lines).strip()
                lines = []
    if lines:
        yield "\n".join(lines).strip()


def open_arrow(source: pa.NativeFile) -> pa.ipc.RecordBatchStreamReader | pa.ipc.RecordBatchFileReader:
    """An arrow file's reader: the IPC stream format (what `datasets` writes), else the file format."""
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_file(source)


def arrow_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.OSFile(str(path)) as source:
        reader = open_arrow(source)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            yield from reader


def table_schema(path: Path) -> pa.Schema:
    if path.suffix == ".parquet":
        return pq.read_schema(path)
    with pa.OSFile(str(path)) as source:
        return open_arrow(source).schema


def table_documents(path: Path, field: str) -> Iterator[str]:
    """The non-empty strings of column `field`, stripped, row by row."""
    batches = (pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=[field]) if path.suffix == ".parquet"
               else arrow_batches(path))
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        yield from (s for s in (v.strip() for v in column.to_pylist() if v) if s)


def documents(path: Path, field: str) -> Iterator[str]:
    return text_documents(path) if path.suffix == ".txt" else table_documents(path, field)


def check_input(path: Path, field: str) -> None:
    """A readable input of a known kind, holding the text field (tables): ConfigError otherwise."""
    require(path.suffix in KINDS, f"{path} is not a {', '.join(KINDS)} file", "INPUT",
            "give text files or Hugging Face parquet/arrow files")
    if path.suffix == ".txt":
        return
    try:
        schema = table_schema(path)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"cannot read {path} ({err})", "INPUT", "replace the file") from None
    require(field in schema.names, f"{path} has no column {field!r} (it has {', '.join(schema.names)})",
            "--text-field", "name the column that holds the text")
    kind = schema.field(field).type
    require(pa.types.is_string(kind) or pa.types.is_large_string(kind), f"column {field!r} of {path} holds {kind}, "
            "not text", "--text-field", "name a string column")


def expand_inputs(items: list[str]) -> list[Path]:
    """The input files: each file given, and each folder's files of a known kind in name order."""
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        require(path.exists(), f"input {item} does not exist", "INPUT", "give existing files or folders")
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in KINDS)
            require(bool(found), f"folder {item} holds no {', '.join(KINDS)} file", "INPUT",
                    "give a folder of text, parquet or arrow files")
            files += found
        else:
            files.append(path)
    resolved = [p.resolve() for p in files]
    require(len(set(resolved)) == len(resolved), "an input file is given twice", "INPUT", "give each file once")
    return resolved


_TOKENIZERS: dict[str, PretrainedTokenizer] = {}


def tokenizer_of(spec: str) -> PretrainedTokenizer:
    """The tokenizer, loaded once per process; its errors name --tokenizer."""
    if spec not in _TOKENIZERS:
        try:
            _TOKENIZERS[spec] = PretrainedTokenizer.load(spec)
        except ConfigError as err:
            raise ConfigError(err.what, "--tokenizer", err.fix) from None
    return _TOKENIZERS[spec]


def kept_record(job: Job) -> dict | None:
    """The shard's record when the shard can be kept: same source, tokenizer and text field, checksums match."""
    out, name = Path(job.out), f"{job.number:05d}"
    try:
        record = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
        same = all(record.get(k) == v for k, v in job.expected.items()) and record.get("dtype") == job.dtype
        return record if same and sha256_file(out / record["tokens_file"]) == record["sha256"] and \
            sha256_file(out / record["documents_file"]) == record["documents_sha256"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_shard(job: Job) -> dict:
    """Tokenize one input into its shard (or keep the shard): {"record", "kept"}, or {"error": ConfigError args}
    (an exception crossing the process boundary would lose its setting and fix)."""
    try:
        record = kept_record(job)
        if record is not None:
            return {"record": record, "kept": True}
        tok, source = tokenizer_of(job.tokenizer), Path(job.source)
        writer = ShardWriter(Path(job.out), job.number, job.dtype, tok.eos_id)
        try:
            batch = []
            for doc in documents(source, job.text_field):
                batch.append(doc)
                if len(batch) == BATCH:
                    writer.add(tok.encode_batch(batch))
                    batch = []
            writer.add(tok.encode_batch(batch) if batch else [])
            require(writer.num_tokens > 0, f"{source} holds no text", "INPUT", "leave out empty files")
            return {"record": writer.finish(dict(job.expected)), "kept": False}
        except BaseException:
            writer.abandon()
            raise
    except ConfigError as err:
        return {"error": (err.what, err.setting, err.fix)}
    except (OSError, UnicodeDecodeError, pa.ArrowException) as err:
        return {"error": (f"cannot read {job.source} ({err})", "INPUT", "replace the file with a readable copy")}


def quiet_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism: no thread pool each


def run_jobs(jobs: list[Job], workers: int) -> list[dict]:
    """make_shard of every job, in `workers` processes (here when 1), a line per shard; results in job order."""
    results: dict[int, dict] = {}
    if workers == 1:
        outcomes = map(make_shard, jobs)
    else:
        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)), initializer=quiet_worker)
        outcomes = pool.imap_unordered(make_shard, jobs)
    try:
        for outcome in outcomes:
            if "error" in outcome:
                raise ConfigError(*outcome["error"])
            record = outcome["record"]
            results[record["number"]] = outcome
            print(f"shard {record['number']:05d} <- {record['source']}: {record['num_documents']} documents, "
                  f"{record['num_tokens']} tokens" + (" (kept: checksums match)" if outcome["kept"] else ""),
                  flush=True)
    finally:
        if workers > 1:
            pool.terminate()
    return [results[job.number] for job in jobs]


def copy_tokenizer(spec: str, out: Path) -> None:
    """tokenizer.json (and tokenizer_config.json) into out/tokenizer/, which the reader decodes with."""
    file = pretrained_file(spec)
    (out / "tokenizer").mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = file if name == "tokenizer.json" else file.parent / name
        if src.is_file():
            replace_atomically(out / "tokenizer" / name, src.read_bytes())


def plan(args: argparse.Namespace) -> list[Job]:
    """The jobs, every input checked first (ConfigError before any work)."""
    require(args.workers >= 1, f"--workers {args.workers} is not positive", "--workers", "give 1 or more processes")
    require(bool(args.text_field), "the text field is empty", "--text-field", "name the column holding the text")
    tok = tokenizer_of(str(args.tokenizer))
    files = expand_inputs(args.inputs)
    for path in files:
        check_input(path, args.text_field)
    out = Path(args.out).expanduser()
    require(not out.exists() or out.is_dir(), f"{out} is a file", "--out", "give a folder (made when missing)")
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, path in enumerate(files):
        stat = path.stat()
        expected = {"source": str(path), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
                    "tokenizer": tok.fingerprint, "text_field": args.text_field}
        jobs.append(Job(i, str(path), str(out), str(args.tokenizer), args.text_field, dtype_for(tok.vocab_size),
                        expected))
    return jobs


def write_index(out: Path, spec: str, records: list[dict]) -> dict:
    tok = tokenizer_of(spec)
    name = pretrained_file(spec).parent.name
    index = {"format": FORMAT, "version": VERSION,
             "tokenizer": {"name": name, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                           "eos_id": tok.eos_id, "eos_token": tok.eos_token},
             "num_documents": sum(r["num_documents"] for r in records),
             "num_tokens": sum(r["num_tokens"] for r in records), "shards": records}
    replace_atomically(out / INDEX, json.dumps(index, indent=1).encode())
    return index


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m utils.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text (.txt), parquet or arrow files, or folders")
    p.add_argument("--tokenizer", required=True, type=Path, help="Hugging Face tokenizer folder (or tokenizer.json)")
    p.add_argument("--out", required=True, type=Path, help="the folder of shards and index.json (made if missing)")
    p.add_argument("--workers", type=int, default=1, help="processes tokenizing files in parallel")
    p.add_argument("--text-field", default="text", help="the column holding the text (parquet, arrow)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        jobs = plan(args)
        outcomes = run_jobs(jobs, args.workers)
    except ConfigError as err:
        exit_bad_input(err)
    out = Path(args.out).expanduser()
    copy_tokenizer(str(args.tokenizer), out)
    index = write_index(out, str(args.tokenizer), [o["record"] for o in outcomes])
    kept = sum(o["kept"] for o in outcomes)
    print(f"{out / INDEX}: {len(jobs)} shards ({kept} kept), {index['num_documents']} documents, "
          f"{index['num_tokens']} tokens, {jobs[0].dtype}, tokenizer {index['tokenizer']['name']} "
          f"(vocabulary {index['tokenizer']['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
