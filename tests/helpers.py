"""What the tests share: the repository root, the tiny workloads spelled once, runners for the entry points,
readers of a run's TensorBoard events, and multi-rank functions on the rank pool.

Workloads: `QUIET` (no validation but the last, no checkpoint but the last, no data worker processes, no
figure: tests/test_tensorboard.py, test_tasks.py, test_train_e2e.py and test_forecast.py check them) and
`TINY_GPT` (the tiny language model on the sample corpus), which test files extend with what they vary;
`make_tokenizer` saves a tiny pretrained-style tokenizer folder (tokenizer.json) trained on the sample corpus.

Multi-rank functions: Run a function on N gloo ranks, for multi-rank tests on CPU.

`run_ranks(fn, world_size, tmp_path, *args)` runs `fn(rank, world_size, *args)` on `world_size` ranks of
the test process's pool (tests/rank_pool.py: processes started once and reused, with RANK/WORLD_SIZE/
LOCAL_RANK set as torchrun would, so `utils.comm.init_grid` finds the launch), after initializing
torch.distributed (gloo) in each. Any exception in any rank is re-raised in the parent with the rank's
traceback; a run that fails on one rank or exceeds `timeout_s` replaces the pool's processes instead of
hanging. `fresh=True` spawns new processes instead (the original path, kept for tests that must own
their processes). `fn` must be a module-level (picklable) function.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["trainer.val_every=0", "trainer.val_at_start=false", "trainer.ckpt_every=0", "trainer.num_workers=0",
         "trainer.log_images=false"]
# 64 wide (head dim 16) instead of the tiny configs' 128: every tp/cp split stays whole, and bf16/fp16 matmuls,
# which CPUs without AVX-512 run at a tenth of fp32's speed, cost a quarter
NARROW = ["model.embed_dim=64"]
TINY_GPT = ["model=gpt_tiny", "data=wikitext_sample", "data.seq_len=32", "optim.lr=2e-3", "data.sample_tokens=0"]


def run_entry(script: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an entry point (train.py, train_mp.py) as users do, with a bounded time."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(script: str, *args: str) -> tuple[int, str, str]:
    """An entry point's `main(args)` in this process, for checks that end before any training (bad input):
    (exit status, stdout, stderr). The status of `sys.exit` counts as returned. `script`: a script (train.py)
    or a module's name (utils.export.convert)."""
    import contextlib
    import importlib
    import io

    module = importlib.import_module(Path(script).stem if script.endswith(".py") else script)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def read_tags(run_dir: Path) -> dict[str, list[str]]:
    """Tag names of a run's TensorBoard events by kind (scalars, images, tensors for text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc.Tags()


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run's TensorBoard events: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


DEFAULT_TIMEOUT_S = 60.0


def _worker(rank: int, world_size: int, init_file: str, timeout_s: float, results, fn: Callable, args: tuple):
    """Body of one spawned rank: init gloo, run `fn`, report ('ok' | traceback) to the parent."""
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)  # ranks share a few cores; oversubscription makes tests crawl
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        fn(rank, world_size, *args)
        dist.barrier()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure, assertion or not, goes to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pooled(rank: int, world_size: int, init_file: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    """One pooled rank of `run_ranks`: the process group, `fn`, a closing barrier."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    fn(rank, world_size, *args)
    dist.barrier()


SOURCE_DIRS = ("networks", "distributed", "utils")  # the code under test (an assert there is an invariant's)


def in_code_under_test(path: str | Path) -> bool:
    """Whether a source file belongs to the code under test (SOURCE_DIRS of this repository): an assert raised
    there is an invariant of that code, not a test's comparison."""
    resolved = Path(path).resolve()
    return resolved.is_relative_to(ROOT) and resolved.relative_to(ROOT).parts[0] in SOURCE_DIRS


class RankAssertion(AssertionError):
    """A rank failed an assertion of the test's own code (a comparison made on the rank), as opposed to an error
    or an assert of the code under test, which stay RuntimeErrors: tests/planted_bugs.py counts only the former as
    a comparison that failed."""


def rank_failure(rank: int, error: str) -> Exception:
    """The exception `run_ranks` raises for a rank's traceback `error`: RankAssertion when it ends in an
    AssertionError raised outside the code under test (SOURCE_DIRS), else RuntimeError."""
    files = re.findall(r'^  File "([^"]+)", line \d+', error, re.M)
    tail = error[error.rfind('  File "'):] if files else error
    if re.search(r"^AssertionError\b", tail, re.M) and not (files and in_code_under_test(files[-1])):
        return RankAssertion(f"rank {rank} failed an assertion:\n{error}")
    return RuntimeError(f"rank {rank} failed:\n{error}")


def run_ranks(fn: Callable, world_size: int, tmp_path: Path | str, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
              fresh: bool = False) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails."""
    init_file = Path(tmp_path) / f"dist_init_{time.monotonic_ns()}"
    if not fresh:
        from tests.rank_pool import pool

        results = pool().run(_pooled, world_size, str(init_file), timeout_s, fn, args, timeout_s=timeout_s + 30)
        failed = [(r, res.error) for r, res in enumerate(results) if res.error is not None]
        failed.sort(key=lambda f: f[1].startswith("stopped:"))  # the rank that failed first, not those it stopped
        if failed:
            raise rank_failure(*failed[0])
        return
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, str(init_file), timeout_s, results, fn, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        results.join_thread()


def _collect(procs: list, results, timeout_s: float) -> None:
    """Wait for every rank's report; raise on the first failure, a silent death or the deadline."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(procs)))
    while pending:
        try:
            rank, error = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r in pending if not procs[r].is_alive() and procs[r].exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s")
            continue
        if error is not None:
            raise rank_failure(rank, error)
        pending.discard(rank)


def corpus_lines(sample: Path, split: str) -> list[str]:
    return [s for s in (line.strip() for line in open(sample / f"wiki.{split}.tokens", encoding="utf-8")) if s]


def make_tokenizer(folder: Path, sample: Path, specials: list[str], eos_token=None, bos: str | None = None,
                   vocab_size: int = 600) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer: no prefix space) trained on the first train lines, saved as
    folder/tokenizer.json; `eos_token` (str or AddedToken dict) goes into a tokenizer_config.json; `bos`
    gives it Llama's post-processor, which puts that token before every encoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_lines(sample, "train")[:400], trainer)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if eos_token is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}), encoding="utf-8")
    return folder
