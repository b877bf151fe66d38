"""Weights exchanged with the Hugging Face layout, for every family with an adapter (`ModelSpec.hf`).

A Hugging Face folder holds config.json and the weights as safetensors (model.safetensors, or shards
listed by model.safetensors.index.json), often with the tokenizer files beside them. config.json's model_type
names the family (the one whose adapter lists it); its adapter (networks/exchange.py `HFAdapter`, in the family's
folder: networks/gpt/hf.py, networks/llama/hf.py) reads and writes config.json and gives the rule each of our
tensors is made by. Everything else is here, the same for every family: the folder, the checks, the vocabulary
padding, import of whole tensors and export.

Vocabulary rows: the checkpoints of this project pad the vocabulary to a multiple of `model.vocab_multiple`
with zero rows (the adapter's `vocab_rows`); import pads, export drops the padding. Nothing here touches
the network: a folder is read from disk or written to it. Here the conversions take whole tensors (import-hf,
tests); utils/checkpoints/hf_stream.py applies the same rules to slices (`trainer.init_from`: each rank reads its
pieces) and writes a folder a shard at a time (export-hf).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from networks.exchange import HFAdapter, Rule, assemble, disassemble, stored_shapes
from networks.spec import ModelSpec
from utils import ConfigError, require
from utils.tasks.registry import families, spec_of


# ---------------------------------------------------------------------------------------------- folders
def read_config(folder: Path) -> dict:
    """config.json of a Hugging Face model folder."""
    config_file = folder / "config.json"
    require(config_file.is_file(), f"{folder} holds no config.json", "DIR",
            "give a folder in the Hugging Face layout (config.json and *.safetensors)")
    try:
        return json.loads(config_file.read_text())
    except ValueError as err:
        raise ConfigError(f"{config_file} is not JSON ({err})", "DIR", "give an intact model folder") from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder's weights (one file, or the shards its index lists)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    require(files and all(f.is_file() for f in files), f"{folder} holds no (or not every) safetensors file of "
            "its weights", "DIR", "give a folder with model.safetensors or the shards its index lists "
            "(a pytorch_model.bin folder: convert it with transformers' save_pretrained(safe_serialization=True))")
    return files


def unreadable(file: Path, err: Exception) -> ConfigError:
    """The one-line error of a safetensors file that cannot be read (safetensors raises its own error types)."""
    return ConfigError(f"{file} cannot be read ({' '.join(str(err).split())[:200]})", "DIR",
                       "give an intact model folder")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors weights, all at once (import-hf; init_from reads
    slices instead: utils/checkpoints/hf_stream.py)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in weight_files(folder):
        try:
            tensors.update(load_file(file))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise unreadable(file, err) from None
    return tensors


def read_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of the safetensors weights) of a Hugging Face model folder."""
    return read_config(folder), read_weights(folder)


def exchanging() -> dict[str, ModelSpec]:
    """config.json model_type -> the family whose adapter reads it."""
    return {kind: spec for spec in families().values() if spec.hf is not None for kind in spec.hf.model_types}


def adapter(model) -> HFAdapter:
    """The Hugging Face adapter of the model config `model`'s family (a one-line error for a family without)."""
    spec = spec_of(model.arch)
    require(spec.hf is not None, f"the {spec.name} model exchanges no weights with Hugging Face", "model",
            f"use a model of {', '.join(s.name for s in set(exchanging().values()))}")
    return spec.hf


def model_settings(config: dict) -> tuple[str, dict[str, object]]:
    """(arch, model.* settings) of a Hugging Face config.json: what the project's model must be set to."""
    kind, known = config.get("model_type"), exchanging()
    require(kind in known, f"config.json's model_type is {kind!r}", "DIR",
            f"give a model of type {' or '.join(repr(k) for k in known)}")
    spec = known[kind]
    return spec.arch, spec.hf.settings(config)


def differences(model, arch: str, settings: dict[str, object]) -> list[str]:
    """The `model=...` and `model.key=value` settings (as overrides) in which the config `model` differs from a
    folder's (of family `arch`)."""
    if model.arch != arch:
        spec = spec_of(arch)
        return [f"model={spec.tiny}", *spec.hf.differences(spec.schema(), settings)]
    return adapter(model).differences(model, settings)


def import_rules(model, vocab: int) -> tuple[dict[str, Rule], dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(our name -> its Rule, their name -> its shape as stored, our name -> its single-process shape, vocabulary
    padded) for the model config `model` and a folder's vocabulary `vocab`."""
    padded = expected_shapes(model, vocab, padded=True)
    unpadded = expected_shapes(model, vocab)
    rules = adapter(model).rules(model, unpadded)
    return rules, stored_shapes(rules, unpadded), padded


def to_project(model, vocab: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict (as stored) -> the project's single-process fp32 state dict, vocabulary padded as
    `model` pads it (a tie stays one tensor). Missing, misshapen or left-over tensors are refused (ConfigError)."""
    hf = adapter(model)
    rules, wanted, shapes = import_rules(model, vocab)
    src = {name: t for stored, t in tensors.items() if (name := hf.stored(stored)) is not None}
    for name, shape in wanted.items():
        require(name in src, f"the weights lack {name}", "DIR", "give the complete model folder")
        require(tuple(src[name].shape) == shape, f"{name} has shape {tuple(src[name].shape)}, config.json implies "
                f"{shape}", "DIR", "give weights that match their config.json")
    extra = sorted(set(src) - set(wanted) - hf.tolerated(model))
    require(not extra, f"the weights hold {len(extra)} tensors a {model.arch} model of config.json has not "
            f"(e.g. {extra[0] if extra else ''})", "DIR", "check that config.json's depth and options describe these "
            "weights")
    tied = hf.tied(model)
    state = {key: assemble(rule, shapes[key], src) for key, rule in rules.items() if key not in tied}
    state.update({key: state[source] for key, source in tied.items()})
    return {key: state[key] for key in shapes}


def check_folder(folder: Path, model, vocab_size: int | None = None) -> dict:
    """config.json of a Hugging Face folder, checked against the model config `model` (and the tokenizer's
    `vocab_size`) before any weight is read: one line naming the settings to change when they differ."""
    config = read_config(folder)
    arch, settings = model_settings(config)
    wrong = differences(model, arch, settings)
    require(not wrong, f"{folder} holds another model than the one configured", "model", "set " + " ".join(wrong))
    vocab = config["vocab_size"]
    require(vocab_size is None or vocab == vocab_size, f"{folder}'s model has {vocab} tokens, the tokenizer "
            f"{vocab_size}", "data.tokenizer", f"read the data with the model's own tokenizer: data.tokenizer={folder}")
    return config


def import_state(folder: Path, model, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """The project's state dict (vocabulary padded as `model` pads it) of a Hugging Face folder (`check_folder`
    first; then every tensor present, none left over, each of the shape config.json implies)."""
    config = check_folder(folder, model, vocab_size)
    return to_project(model, config["vocab_size"], read_weights(folder))


def schema_of(arch: str):
    """The model config schema of a family tag."""
    return spec_of(arch).schema


def expected_shapes(model, vocab: int, padded: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of the single-process model's state (the vocabulary unpadded, or `padded`), built on the meta
    device by the family's adapter."""
    hf = adapter(model)
    with torch.device("meta"):
        serial = hf.build(model, vocab)
    shapes = {k: tuple(v.shape) for k, v in serial.state_dict().items()}
    return shapes if padded else {k: (vocab, *s[1:]) if k in hf.vocab_rows else s for k, s in shapes.items()}


# ----------------------------------------------------------------------------------------------- export
def hf_config(model, vocab_size: int, eos_id: int | None = None, bos_id: int | None = None,
              pad_id: int | None = None) -> dict:
    """config.json of the Hugging Face model with `model`'s settings (refused where it has no such model);
    the ids of the tokenizer's end-of-text token (generation stops at it), its beginning and padding tokens
    (None, written as null, where it has none: transformers' defaults name ids of other vocabularies)."""
    tokens = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    return adapter(model).config(model, vocab_size, tokens)


def export_rules(model, vocab_size: int) -> tuple[dict[str, Rule], dict[str, tuple[int, ...]]]:
    """(our name -> its Rule, their name -> its stored shape) for writing the model config `model`'s weights."""
    rules, wanted, _ = import_rules(model, vocab_size)
    return rules, wanted


def hf_tensors(model, key: str, tensor: torch.Tensor, vocab_size: int,
               rules: tuple[dict[str, Rule], dict[str, tuple[int, ...]]] | None = None) -> dict[str, torch.Tensor]:
    """Our single-process tensor `key` (padded vocabulary) -> the Hugging Face tensors made of it (fresh,
    contiguous fp32, under their stored names); none for a tied tensor (the one it is written as). A meta
    `tensor` gives their shapes. `rules`: `export_rules(model, vocab_size)`, computed once by a caller of many."""
    hf = adapter(model)
    if key in hf.tied(model):
        return {}
    rules_of, wanted = rules or export_rules(model, vocab_size)
    if key not in rules_of:
        return {}
    return {hf.storage(name): t for name, t in disassemble(rules_of[key], tensor, wanted).items()}


def from_project(model, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The project's single-process state dict (padded vocabulary) -> a Hugging Face state dict."""
    rules = export_rules(model, vocab_size)
    return {name: t for key, tensor in state.items()
            for name, t in hf_tensors(model, key, tensor, vocab_size, rules).items()}
