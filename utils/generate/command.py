"""Text sampled from a language model: a checkpoint of any layout, or a Hugging Face folder.

    python -m utils.generate runs/<run> --prompt "The castle" --max-new-tokens 40     # its newest complete step
    python -m utils.generate runs/<run>/checkpoints/step_0000100 --prompt "The castle"
    python -m utils.generate hf/<name> --prompts prompts.txt --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1
    torchrun --nproc-per-node 2 -m utils.generate hf/<name> --prompt "The castle" --temperature 0

A run directory, its checkpoints/ folder or checkpoints/latest stands for the step folder it names (the newest
complete one: utils/checkpoints/run_dir.py `resolve_step`; the step taken is printed on stderr). The source is
opened as every tool opens a model (utils/engine/session.py): a checkpoint is read in one process (every shard,
any layout; the model's entries only), with the run's model settings (config.yaml) and tokenizer
(`data.tokenizer`: the word or BPE vocabulary trained on the run's corpus, found in its cache, or the tokenizer
folder it named; `--tokenizer` overrides). A Hugging Face folder (of a family with an adapter: GPT-2, Llama)
brings its tokenizer.json. `--prompts FILE` holds one prompt per line, sampled as one batch (`--padding
left|right`: the result is the same). Sampling, the KV cache and the padding are utils/language/task/sampling.py's.
Launched on several ranks (torchrun; `python train_mp.py` starts only train.py), the model is built tensor
parallel over them as training builds it (`Opened.sharded`: tp = the ranks, no sequence parallelism), each rank
holding its heads and their KV cache; every rank picks the same tokens and rank 0 prints. Each sample prints as
its prompt followed by the continuation (up to the end-of-text token), one blank line between samples; the
throughput goes to stderr, and a warning when a prompt's words are not in the tokenizer's vocabulary (they read
as its unknown token).
Bad input (a missing folder, a checkpoint of the weather model, a top-p outside (0, 1], a tp that does not divide
the heads, ...): one line on stderr, exit 2, before any work.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from utils import ConfigError, exit_bad_input, require
from utils.comm import Axis, AxisGroup, ends_its_grid
from utils.language.task.sampling import PADDINGS, Sampling, sample
from utils.launch_env import launch_env


@dataclass
class Source:
    """A model ready to sample from, and the tokenizer of its vocabulary."""

    model: torch.nn.Module  # the family's model (or this rank's shards of it), eval mode
    tokenizer: object  # utils.language.data.tokenizers.AnyTokenizer
    eos_id: int | None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m utils.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path, help="a run directory (its newest complete step), a step_* folder of its "
                   "checkpoints/, or a Hugging Face model folder")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="one prompt")
    text.add_argument("--prompts", type=Path, help="a text file: one prompt per non-blank line, sampled as a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add to each prompt at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the likeliest tokens reaching this probability")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole text at each token")
    p.add_argument("--padding", choices=PADDINGS, default="left", help="where shorter prompts of a batch are padded")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder or tokenizer.json (default: the source's)")
    p.add_argument("--data", nargs="*", default=[], metavar="data.KEY=VALUE",
                   help="where the run's corpus now lies (its word or BPE tokenizer is cached there)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def read_prompts(args) -> list[str]:
    """The prompts of --prompt or --prompts (ConfigError when there are none)."""
    if args.prompt is not None:
        require(args.prompt.strip() != "", "the prompt is empty", "--prompt", "give some text")
        return [args.prompt]
    require(args.prompts.is_file(), f"{args.prompts} is not a file", "--prompts", "give a text file, a prompt a line")
    try:
        lines = [s for s in (line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines()) if s]
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {args.prompts} ({err})", "--prompts", "give a UTF-8 text file") from None
    require(bool(lines), f"{args.prompts} holds no prompt", "--prompts", "write one prompt per line")
    return lines


def load_tokenizer_file(path: Path):
    from utils.language.data.tokenizers import PretrainedTokenizer

    try:
        return PretrainedTokenizer.load(str(path))
    except ConfigError as err:
        raise ConfigError(err.what, "--tokenizer", err.fix) from None


def source_tokenizer(opened, tokenizer: Path | None):
    """The tokenizer of an opened source (utils/engine/session.py): `tokenizer` when given, else a Hugging Face
    folder's tokenizer.json or the one the run trained with; its vocabulary checked against the model's."""
    if opened.is_hf:
        folder = opened.folder
        require(tokenizer is not None or (folder / "tokenizer.json").is_file(), f"{folder} holds no tokenizer.json",
                "--tokenizer", "give the model's tokenizer folder or tokenizer.json")
        tok = load_tokenizer_file(tokenizer or folder)
        require(tok.vocab_size <= opened.vocab, f"the tokenizer has {tok.vocab_size} tokens, the model "
                f"{opened.vocab}", "--tokenizer", "give the model's own tokenizer")
        return tok
    run_dir = opened.folder.parent.parent
    require(opened.vocab is not None, f"{run_dir} records no vocabulary size (task.json)", "CHECKPOINT",
            "resume the run for one step with this version, then sample")
    tok = load_tokenizer_file(tokenizer) if tokenizer is not None else opened.data_cfg.trained_tokenizer()
    require(tok.vocab_size == opened.vocab, f"the tokenizer has {tok.vocab_size} tokens, the run's model "
            f"{opened.vocab}", "--tokenizer", "give the tokenizer the run trained with")
    return tok


SOURCE = "CHECKPOINT_OR_HF_FOLDER"  # the setting a bad source is named by


def open_source(args, sampling: bool = False):
    """(the source opened: utils/engine/session.py, no weight read; its tokenizer). A run folder stands for its
    newest complete step: rank 0 says on stderr which step it took. `sampling`: a family that does not decode token
    by token (`ModelSpec.decodes`) is refused."""
    from utils.engine.session import open_model
    from utils.tasks.registry import families

    opened = open_model(args.source, SOURCE, kind="wikitext", data=args.data)
    decoding = [spec.name for spec in families().values() if spec.decodes]
    require(opened.family.decodes or not sampling, f"the {opened.family.name} model does not decode token by token "
            "(no KV-cached forward(idx, decode))", SOURCE, f"sample from a model whose family decodes "
            f"({', '.join(decoding)}); python -m utils.evaluate scores any language model")
    if opened.taken is not None and launch_env().rank == 0:
        print(opened.taken, file=sys.stderr)
    return opened, source_tokenizer(opened, args.tokenizer)


def unknown_words(tokenizer, lines: list[str]) -> list[str]:
    """The words of `lines` (split at white space) that encode to the tokenizer's unknown token, in order, once
    each; none for a tokenizer without one (a byte-level BPE never needs it)."""
    unk, hf = getattr(tokenizer, "unk_id", None), getattr(tokenizer, "tokenizer", None)
    if unk is None and hf is not None and getattr(hf.model, "unk_token", None):
        unk = hf.token_to_id(hf.model.unk_token)
    if unk is None:
        return []
    words = list(dict.fromkeys(word for line in lines for word in line.split()))
    return [word for word, ids in zip(words, tokenizer.encode_batch(words), strict=True) if unk in ids]


def unknown_warning(tokenizer, lines: list[str]) -> str | None:
    """A one-line warning naming the prompts' words the vocabulary lacks (`unknown_words`), or None."""
    words = unknown_words(tokenizer, lines)
    if not words:
        return None
    shown = ", ".join(f'"{w}"' for w in words[:8]) + (f" and {len(words) - 8} more" if len(words) > 8 else "")
    name = getattr(getattr(getattr(tokenizer, "tokenizer", None), "model", None), "unk_token", None) or "<unk>"
    return (f"warning: the prompt's word{'s' if len(words) > 1 else ''} {shown} {'are' if len(words) > 1 else 'is'} "
            f"not in the tokenizer's vocabulary; {'they read' if len(words) > 1 else 'it reads'} as {name}")


def encode(source: Source, lines: list[str], new_tokens: int) -> list[list[int]]:
    """Token ids of each prompt; ConfigError for a prompt of no tokens or a text longer than the model's context."""
    prompts = source.tokenizer.encode_batch(lines)
    require(all(prompts), "a prompt encodes to no token", "--prompt", "give prompts with some text")
    longest, limit = max(map(len, prompts)), source.model.cfg.max_positions
    require(longest + new_tokens <= limit, f"the longest prompt ({longest} tokens) and --max-new-tokens {new_tokens} "
            f"exceed the model's {limit} positions", "--max-new-tokens", f"give at most {limit - longest}")
    return prompts


def load(args) -> tuple[Source, AxisGroup | None, str, bool]:
    """(the source: the whole model, or this rank's tensor-parallel shards; the tp axis (None: one process); the
    device; whether this rank prints)."""
    world = launch_env().world_size
    opened, tokenizer = open_source(args, sampling=True)
    if world == 1:
        return Source(opened.serial(args.device), tokenizer, tokenizer.eos_id), None, args.device, True
    model, grid = opened.sharded(tp=world, pp=1, sequence_parallel=False)
    source = Source(model, tokenizer, tokenizer.eos_id)
    return source, grid.axis(Axis.TP), f"{grid.device}, tp{world}", grid.is_main


@ends_its_grid()
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        require(args.max_new_tokens > 0, f"--max-new-tokens {args.max_new_tokens}", "--max-new-tokens",
                "give a positive number of tokens")
        lines = read_prompts(args)
        source, tp, device, main_rank = load(args)
        prompts = encode(source, lines, args.max_new_tokens)
    except ConfigError as err:
        exit_bad_input(err)
    if main_rank and (warning := unknown_warning(source.tokenizer, lines)) is not None:
        print(warning, file=sys.stderr)
    start = time.perf_counter()
    outs = sample(source.model, prompts, args.max_new_tokens, sampling, eos_id=source.eos_id, seed=args.seed,
                  cache=not args.no_kv_cache, padding=args.padding, tp=tp)
    seconds = time.perf_counter() - start
    if not main_rank:
        return 0
    trim = [o[:-1] if o and o[-1] == source.eos_id else o for o in outs]  # the end token is not text
    print("\n\n".join(source.tokenizer.decode(p + o) for p, o in zip(prompts, trim, strict=True)))
    count = sum(map(len, outs))
    print(f"{count} tokens in {seconds:.2f} s ({count / seconds:.1f} tokens/s, {len(prompts)} prompts, KV cache "
          f"{'off' if args.no_kv_cache else 'on'}, {device})", file=sys.stderr)
    return 0
