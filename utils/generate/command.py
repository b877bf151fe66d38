"""Text sampled from a language model: a checkpoint of any layout, or a Hugging Face folder.

    python -m utils.generate runs/<run> --prompt "The castle" --max-new-tokens 40     # its newest complete step
    python -m utils.generate runs/<run>/checkpoints/step_0000100 --prompt "The castle"
    python -m utils.generate hf/<name> --prompts prompts.txt --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1
    torchrun --nproc-per-node 2 -m utils.generate hf/<name> --prompt "The castle" --temperature 0

A run directory, its checkpoints/ folder or checkpoints/latest stands for the step folder it names (the newest
complete one: utils/checkpoints/run_dir.py `resolve_step`; the step taken is printed on stderr). A checkpoint is
read in one process as export reads it (every shard, any layout; the model's entries only), with
the run's model settings (config.yaml) and tokenizer (`data.tokenizer`: the word or BPE vocabulary trained on the
run's corpus, found in its cache, or the tokenizer folder it named; `--tokenizer` overrides). A Hugging Face
folder (GPT-2, Llama: utils/checkpoints/hf.py) brings its tokenizer.json. `--prompts FILE` holds one prompt per
line, sampled as one batch (`--padding left|right`: the result is the same). Sampling, the KV cache and the
padding are utils/tasks/sampling.py's. Launched on several ranks (torchrun; `python train_mp.py` starts only
train.py), the model is built tensor parallel over them as `python -m utils.evaluate` builds it
(utils/evaluate/sharded.py: tp = the ranks, no sequence parallelism), each rank holding its heads and their KV
cache; every rank picks the same tokens and rank 0 prints. Each sample prints as its prompt followed by the
continuation (up to the end-of-text token), one blank line between samples; the throughput goes to stderr, and
a warning when a prompt's words are not in the tokenizer's vocabulary (they read as its unknown token).
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
from utils.comm import Axis, AxisGroup
from utils.launch_env import launch_env
from utils.tasks.sampling import PADDINGS, Sampling, sample


@dataclass
class Source:
    """A model ready to sample from, and the tokenizer of its vocabulary."""

    model: torch.nn.Module  # networks.transformer.GPT, eval mode
    tokenizer: object  # utils.data.tokenizers.AnyTokenizer
    eos_id: int | None


@dataclass
class Described:
    """What a source holds, before any weight is read: its model settings, vocabulary size and tokenizer."""

    cfg: object  # networks.transformer.GPTConfig (or LlamaConfig)
    vocab: int  # rows of the model's embedding that are tokens (before padding)
    tokenizer: object  # utils.data.tokenizers.AnyTokenizer


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
    from utils.data.tokenizers import PretrainedTokenizer

    try:
        return PretrainedTokenizer.load(str(path))
    except ConfigError as err:
        raise ConfigError(err.what, "--tokenizer", err.fix) from None


def describe_hf(folder: Path, tokenizer: Path | None) -> Described:
    """A GPT-2 or Llama folder's model settings and tokenizer (tokenizer.json in the folder unless `tokenizer`)."""
    from utils.checkpoints import hf

    config = hf.read_config(folder)
    arch, settings = hf.model_settings(config)
    cfg = hf.schema_of(arch)(**settings)
    require(tokenizer is not None or (folder / "tokenizer.json").is_file(), f"{folder} holds no tokenizer.json",
            "--tokenizer", "give the model's tokenizer folder or tokenizer.json")
    tok = load_tokenizer_file(tokenizer or folder)
    vocab = config["vocab_size"]
    require(tok.vocab_size <= vocab, f"the tokenizer has {tok.vocab_size} tokens, the model {vocab}", "--tokenizer",
            "give the model's own tokenizer")
    return Described(cfg, vocab, tok)


def load_hf(folder: Path, tokenizer: Path | None, device: str) -> Source:
    """A GPT-2 or Llama folder's model and tokenizer, in one process."""
    from networks.transformer import GPT
    from utils.checkpoints import hf

    described = describe_hf(folder, tokenizer)
    with torch.device("meta"):
        model = GPT(described.cfg, described.vocab)
    model.load_state_dict(hf.import_state(folder, described.cfg, described.vocab), assign=True)
    return Source(ready(model, device), described.tokenizer, described.tokenizer.eos_id)


def describe_checkpoint(folder: Path, tokenizer: Path | None, data: list[str]) -> Described:
    """A run's checkpoint (any layout): the run's model settings, vocabulary size and tokenizer."""
    from utils.checkpoints.run_dir import TASK_FILE, load_run, read_facts

    _, model_cfg, data_cfg = load_run(folder, "wikitext", data)  # a complete step folder (resolve_source)
    run_dir = folder.parent.parent
    vocab = (read_facts(run_dir, TASK_FILE) or {}).get("vocab_size")
    require(vocab is not None, f"{run_dir} records no vocabulary size (task.json)", "CHECKPOINT",
            "resume the run for one step with this version, then sample")
    tok = load_tokenizer_file(tokenizer) if tokenizer is not None else run_tokenizer(data_cfg)
    require(tok.vocab_size == vocab, f"the tokenizer has {tok.vocab_size} tokens, the run's model {vocab}",
            "--tokenizer", "give the tokenizer the run trained with")
    return Described(model_cfg, vocab, tok)


def load_checkpoint(folder: Path, tokenizer: Path | None, data: list[str], device: str) -> Source:
    """A run's checkpoint (any layout) in one process, and the run's tokenizer."""
    from networks.transformer import GPT

    described = describe_checkpoint(folder, tokenizer, data)
    with torch.device("meta"):
        model = GPT(described.cfg, described.vocab)
    model.load_state_dict(model_state(folder), assign=True)
    return Source(ready(model, device), described.tokenizer, described.tokenizer.eos_id)


def run_tokenizer(data_cfg):
    """The tokenizer a language run trained with: its corpus's cached word or BPE vocabulary, its folder, or
    (data=tokens) the copy that prepare put beside the shards."""
    from utils.data.cache import cache_folders
    from utils.data.tokenizers import PretrainedTokenizer
    from utils.data.tokens import TokensConfig
    from utils.data.wikitext import load_tokenizer, locate

    if isinstance(data_cfg, TokensConfig):
        try:
            return PretrainedTokenizer.load(data_cfg.tokenizer)
        except ConfigError as err:
            raise ConfigError(err.what, "data.root", "give the run's shard folder: data.root=DIR") from None
    folder, sources = locate(data_cfg)
    return load_tokenizer(data_cfg, sources["train"], cache_folders(folder, data_cfg.cache_dir))[0]


def model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The model's entries of a checkpoint as full tensors (the optimizer's are not read)."""
    import torch.distributed.checkpoint as dcp

    from utils.checkpoints.sharded_state import SafeReader, read_shapes

    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(shape, dtype=metadata[key].properties.dtype)
               for key, shape in read_shapes(folder).items() if key.startswith("model/") and shape is not None}
    dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=True)
    return {key.removeprefix("model/"): t for key, t in tensors.items()}


def ready(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A meta-built model whose weights were assigned, on `device` in eval mode: its computed buffers (rotary
    tables) made there, its head tied again to the embedding when the model ties them."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(torch.device(device))
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.tok_embed.weight
    return model.to(device).eval()


SOURCE = "CHECKPOINT_OR_HF_FOLDER"  # the setting a bad source is named by


def resolve_source(source: Path) -> tuple[Path, str | None]:
    """(the folder to read, a line saying which step was taken or None): a Hugging Face model folder (config.json)
    as it is, else the complete step folder that a run directory, its checkpoints/, checkpoints/latest or a step
    folder names (utils/checkpoints/run_dir.py `resolve_step`); ConfigError for anything else."""
    from utils.checkpoints.run_dir import resolve_step

    if (source / "config.json").is_file():
        return source, None
    step = resolve_step(source, SOURCE, also="a Hugging Face model folder")
    return step, None if step == source else f"reading {step} (from {source})"


def take_source(args) -> None:
    """`args.source` resolved (`resolve_source`); rank 0 says on stderr which step a run folder stood for."""
    args.source, taken = resolve_source(args.source)
    if taken is not None and launch_env().rank == 0:
        print(taken, file=sys.stderr)


def check_source(source: Path) -> bool:
    """Whether `source`, resolved by `resolve_source`, is a Hugging Face folder (else a run's step folder)."""
    return (source / "config.json").is_file()


def describe_source(args) -> Described:
    """The model settings and tokenizer of a Hugging Face folder or a run's checkpoint (no weights read)."""
    if check_source(args.source):
        return describe_hf(args.source, args.tokenizer)
    return describe_checkpoint(args.source, args.tokenizer, args.data)


def load_source(args) -> Source:
    """The model and tokenizer of a Hugging Face folder or a run's checkpoint."""
    if check_source(args.source):
        return load_hf(args.source, args.tokenizer, args.device)
    return load_checkpoint(args.source, args.tokenizer, args.data, args.device)


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
    from utils.evaluate.sharded import ranks_of_launch, sharded_model

    world = ranks_of_launch()
    take_source(args)
    if world == 1:
        return load_source(args), None, args.device, True
    described = describe_source(args)
    model, grid = sharded_model(described, args.source, tp=world, pp=1, sequence_parallel=False)
    source = Source(model, described.tokenizer, described.tokenizer.eos_id)
    return source, grid.axis(Axis.TP), f"{grid.device}, tp{world}", grid.is_main


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
