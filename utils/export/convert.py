"""A checkpoint of any layout as one torch.save file of the single-process state, or as a Hugging Face
model folder, and back.

    python -m utils.export export runs/<run>/checkpoints/step_0000100 model.pt
    python -m utils.export import model.pt runs/<new run>      # -> runs/<new run>/checkpoints/step_0000100
    python -m utils.export export-hf runs/<run>/checkpoints/step_0000100 hf/<name>
    python -m utils.export import-hf hf/<name> runs/<new run>  # -> runs/<new run>/checkpoints/step_0000000

The file holds plain tensors of the one-process model, readable without this project:

    {"model": state_dict,                                  torch.nn.Module.load_state_dict(file["model"])
     "optimizer": {name: {"exp_avg", "exp_avg_sq", "step"}}, Adam's state per parameter name
     "trainer": {"step", "samples", "lr", "scaler", ...}}

Export reads the checkpoint in one process, one tensor at a time (every shard, any layout; the per-rank RNG
states are left out).
Import writes a complete checkpoint (DCP folder, state.json, marker, `latest`) that any layout resumes with
`trainer.resume=auto run.dir=<new run>` or `trainer.resume=<its step folder>`; random streams are then
re-derived from (seed, step, rank), as for a checkpoint of another layout.

Hugging Face (utils/checkpoints/hf.py): export-hf writes config.json, model.safetensors (shards listed by
model.safetensors.index.json past --shard-mib; read and written a tensor at a time) and the tokenizer the run
trained with (word, bpe, a tokenizer folder, the shards' copy; or --tokenizer) as tokenizer.json and
tokenizer_config.json (utils/language/data/tokenizers.py `hf_files`), of a GPT-2 or Llama run, which transformers'
`from_pretrained` loads (AutoModelForCausalLM, AutoTokenizer); import-hf writes a checkpoint of the model
weights at step 0, for a new run with `trainer.init_from=<its step folder>` (or give the folder itself:
`trainer.init_from=hf/<name>`), and prints the model settings that run needs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from utils import ConfigError, exit_bad_input, require
from utils.checkpoints import hf
from utils.checkpoints.checkpointer import Checkpointer
from utils.checkpoints.hf_stream import SHARD_BYTES, WeightStream, write_folder
from utils.checkpoints.run_dir import resolve_step
from utils.checkpoints.sharded_state import SafeReader, iter_full
from utils.comm import Grid
from utils.language.data.tokenizers import TOKENIZER_FILES, AnyTokenizer, hf_files, load_file, special_ids

IMPORTED = "imported from a single-process file"  # the `layout` an imported checkpoint records
IMPORTED_HF = "imported from a Hugging Face folder"


def export_checkpoint(folder: Path, out: Path) -> dict:
    """Write the single-process state of the checkpoint `folder` to `out`; returns it, its tensors fake (shapes
    and dtypes, no values).

    Peak memory: one tensor of the state. torch.save pickles one dict that names every tensor, so the file is
    written in two passes, as torch documents for writers that place the bytes themselves (its GPUDirect Storage
    recipe): first the dict with fake tensors under `torch.serialization.skip_data` (each storage's space
    reserved, no bytes), then each tensor read from the checkpoint alone (`iter_full`) and written at its
    storage's offset in the file (read back as torch does, by loading the file under a fake-tensor mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    checkpointer = Checkpointer(folder.parent.parent, Grid.serial().world)
    if not checkpointer.is_complete(folder):
        raise ConfigError(f"{folder} is not a complete checkpoint", "CHECKPOINT",
                          "give a step_* folder that holds a COMPLETE marker")
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    with FakeTensorMode():
        fake = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in metadata.items()
                if isinstance(meta, TensorStorageMetadata) and key.startswith(EXPORTED)}
    state = nested(fake, checkpointer.read_meta(folder))
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, out)
    with FakeTensorMode():
        placed = torch.load(out, weights_only=True)
    offsets = {key: tensor.untyped_storage()._checkpoint_offset for key, tensor in flat(placed).items()}
    with open(out, "r+b") as file:
        for prefix in EXPORTED:
            for key, tensor in iter_full(folder, prefix):
                file.seek(offsets[key])
                file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
                del tensor  # freed before the next is read
    return state


EXPORTED = ("model/", "optim/")  # the checkpoint's entries the file holds (not the per-rank RNG states)


def nested(tensors: dict[str, torch.Tensor], trainer: dict) -> dict:
    """The file's dict of a checkpoint's flat model/ and optim/<name>/<entry> tensors."""
    state = {"model": {}, "optimizer": {}, "trainer": trainer}
    for key, tensor in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "model":
            state["model"][rest] = tensor
        else:
            name, _, entry = rest.rpartition("/")
            state["optimizer"].setdefault(name, {})[entry] = tensor
    return state


def flat(state: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's keys of the file's tensors (`nested` undone)."""
    tensors = {f"model/{name}": t for name, t in state["model"].items()}
    tensors.update({f"optim/{name}/{entry}": t for name, entries in state["optimizer"].items()
                    for entry, t in entries.items()})
    return tensors


def import_checkpoint(file: Path, run_dir: Path) -> Path:
    """Write the state of an exported `file` as a checkpoint of `run_dir`; returns its step folder."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not {"model", "optimizer", "trainer"} <= state.keys():
        raise ConfigError(f"{file} is not a file written by `python -m utils.export export`", "FILE",
                          "export a checkpoint first (it holds model, optimizer and trainer)")
    tensors = flat(state)
    meta = {**state["trainer"], "layout": IMPORTED}
    return Checkpointer(run_dir, Grid.serial().world).save(int(meta["step"]), tensors, meta)


def export_hf(folder: Path, out: Path, tokenizer: Path | None = None, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the language model of the checkpoint `folder` as a Hugging Face folder `out`; returns config.json.

    Streamed: the checkpoint is read one tensor at a time and written a shard (at most `shard_bytes`) at a time
    (utils/checkpoints/hf_stream.py); peak memory is one shard's converted tensors and the tensor being
    converted, never the whole model."""
    from utils.engine.session import open_model

    require(Checkpointer(folder.parent.parent, Grid.serial().world).is_complete(folder),
            f"{folder} is not a complete checkpoint", "CHECKPOINT", "give a step_* folder that holds a COMPLETE marker")
    opened = open_model(folder, "CHECKPOINT", kind="wikitext", hf_folders=False)
    model, data, vocab = opened.model_cfg, opened.data_cfg, opened.vocab
    require(vocab is not None, f"{folder.parent.parent} records no vocabulary size (task.json, written since the "
            "Hugging Face export)", "CHECKPOINT", "resume the run for one step with this version, then export")
    tok = run_tokenizer(data, tokenizer)
    require(tok.vocab_size == vocab, f"the tokenizer has {tok.vocab_size} tokens, the run's model {vocab}",
            "--tokenizer", "give the tokenizer the run trained with (or none: the run's own)")
    files = hf_files(tok)  # all of the tokenizer's files are made before anything is written
    config = hf.hf_config(model, vocab, **special_ids(files))
    write_folder(out, config, checkpoint_stream(folder, model, vocab), None, shard_bytes)
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)  # an earlier export's would be read beside these
    for name, content in files.items():
        (out / name).write_bytes(content)
    return config


def run_tokenizer(data, tokenizer: Path | None) -> AnyTokenizer:
    """The tokenizer to export: `tokenizer` (a folder or tokenizer.json, or a word or bpe file of a corpus's
    cache) when given, else the one the run trained with: its word or BPE vocabulary (from the corpus's cache,
    as training read it), its tokenizer folder, or (data=tokens) the copy beside its shards."""
    if tokenizer is not None:
        try:
            return load_file(str(tokenizer))
        except ConfigError as err:
            raise ConfigError(err.what, "--tokenizer", err.fix) from None
    try:
        return data.trained_tokenizer()  # a text source's (utils/language/data/text.py)
    except ConfigError as err:
        if data.kind == "tokens" or data.tokenizer not in ("word", "bpe"):
            raise
        raise ConfigError(f"the run's {data.tokenizer} tokenizer cannot be read: {err.what}", "--tokenizer",
                          f"give its cached file (tokenizer-{data.tokenizer}*.json beside the corpus), or "
                          "put the corpus back where the run read it") from None


def checkpoint_stream(folder: Path, model, vocab_size: int) -> WeightStream:
    """The Hugging Face tensors of a checkpoint's model, each produced when asked for from one tensor read alone
    (DCP reads only that entry's chunks); sizes from the metadata (converted on the meta device)."""
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    shapes = {key.removeprefix("model/"): tuple(m.size) for key, m in metadata.items()
              if key.startswith("model/") and isinstance(m, TensorStorageMetadata)}

    rules = hf.export_rules(model, vocab_size)

    def converted(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return hf.hf_tensors(model, key, tensor, vocab_size, rules)

    def produce(key: str) -> dict[str, torch.Tensor]:
        tensor = torch.empty(shapes[key], dtype=metadata[f"model/{key}"].properties.dtype)
        dcp.load({f"model/{key}": tensor}, storage_reader=SafeReader(folder), no_dist=True)
        return converted(key, tensor)

    sizes = {key: sum(t.numel() * t.element_size() for t in converted(key, torch.empty(shape, device="meta")).values())
             for key, shape in shapes.items()}
    return WeightStream({key: n for key, n in sizes.items() if n}, produce)


def import_hf(folder: Path, run_dir: Path, vocab_multiple: int = 64) -> tuple[Path, list[str]]:
    """Write the weights of a Hugging Face folder as a checkpoint of `run_dir` at step 0; returns its step folder
    and the model settings a run needs to start from it."""
    from utils.cli.config import load_config

    config = hf.read_config(folder)
    arch, settings = hf.model_settings(config)
    model = hf.schema_of(arch)(**settings, vocab_multiple=vocab_multiple)
    state = hf.import_state(folder, model)
    tensors = {f"model/{name}": t for name, t in state.items()}
    meta = {"layout": IMPORTED_HF, "source": str(folder), "vocab_size": config["vocab_size"]}
    step = Checkpointer(run_dir, Grid.serial().world).save(0, tensors, meta)
    preset = hf.spec_of(arch).tiny
    base = load_config([f"model={preset}", "data=wikitext_sample"])[0].model
    extra = [] if vocab_multiple == base.vocab_multiple else [f"model.vocab_multiple={vocab_multiple}"]
    return step, [f"model={preset}", *hf.differences(base, arch, settings), *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.export", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("export", help="checkpoint folder -> one torch.save file")
    out.add_argument("checkpoint", type=Path, help="a step_* folder, or a run directory: its newest complete step")
    out.add_argument("file", type=Path)
    back = sub.add_parser("import", help="torch.save file -> a checkpoint of a run directory")
    back.add_argument("file", type=Path)
    back.add_argument("run_dir", type=Path)
    out_hf = sub.add_parser("export-hf", help="checkpoint folder of a GPT-2 or Llama run -> a Hugging Face folder")
    out_hf.add_argument("checkpoint", type=Path, help="a step_* folder, or a run directory: its newest complete step")
    out_hf.add_argument("folder", type=Path)
    out_hf.add_argument("--tokenizer", type=Path, help="tokenizer folder, tokenizer.json or cached word/bpe file to "
                        "write (default: the run's own tokenizer)")
    out_hf.add_argument("--shard-mib", type=int, default=SHARD_BYTES // 2**20,
                        help="largest safetensors file in MiB (past it: shards listed by model.safetensors.index.json)")
    in_hf = sub.add_parser("import-hf", help="Hugging Face folder (GPT-2, Llama) -> a checkpoint of a run directory")
    in_hf.add_argument("folder", type=Path)
    in_hf.add_argument("run_dir", type=Path)
    in_hf.add_argument("--vocab-multiple", type=int, default=64, help="pad the vocabulary as model.vocab_multiple")
    args = parser.parse_args(argv)
    try:
        if args.command in ("export", "export-hf"):  # a run directory, checkpoints/ or latest: the step it names
            given, args.checkpoint = args.checkpoint, resolve_step(args.checkpoint, "CHECKPOINT")
            if args.checkpoint != given:
                print(f"reading {args.checkpoint} (from {given})", file=sys.stderr)
        if args.command == "export":
            state = export_checkpoint(args.checkpoint, args.file)
            count = sum(t.numel() for t in state["model"].values())
            print(f"wrote {args.file}: step {state['trainer']['step']}, {len(state['model'])} model tensors "
                  f"({count / 1e6:.2f}M values), Adam state of {len(state['optimizer'])} parameters")
        elif args.command == "import":
            print(f"wrote {import_checkpoint(args.file, args.run_dir)}")
        elif args.command == "export-hf":
            config = export_hf(args.checkpoint, args.folder, args.tokenizer, args.shard_mib * 2**20)
            load = (f"; load them with transformers' AutoModelForCausalLM.from_pretrained('{args.folder}') and "
                    f"AutoTokenizer.from_pretrained('{args.folder}')") if "architectures" in config else ""
            name = config.get("architectures", [config["model_type"]])[0]  # a family's own layout names no class
            print(f"wrote {args.folder}: {name}, vocabulary {config['vocab_size']}, its tokenizer{load}")
        else:
            step, settings = import_hf(args.folder, args.run_dir, args.vocab_multiple)
            print(f"wrote {step}\nstart a run from it: python train.py {' '.join(settings)} data=wikitext_sample "
                  f"data.tokenizer={args.folder} trainer.init_from={step}\n(on your own corpus: data=wikitext "
                  f"data.root=<the folder of its wiki.*.tokens>)")
    except ConfigError as err:
        exit_bad_input(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
