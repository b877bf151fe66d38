"""Weights exchanged with the Hugging Face layout: GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM).

A Hugging Face folder holds config.json and the weights as safetensors (model.safetensors, or shards
listed by model.safetensors.index.json), often with the tokenizer files beside them. The language
model of this project (networks/transformer.py) is the same computation as both architectures, so the
exchange is a renaming plus three re-orderings:

- GPT-2 stores its linears as Conv1D, (in, out): transposed here. Its fused c_attn orders the output
  features ({q, k, v}, head, head_dim); ours (head, {q, k, v}, head_dim), so that a contiguous split over
  tensor-parallel ranks gives whole heads.
- Llama keeps q_proj, k_proj, v_proj apart; ours is one projection ordered (kv group, [the group's query
  heads, k, v], head_dim). Query head h reads key/value head h // r in both (r = heads / kv heads), and
  both rotate (first half, second half) of each head, so the rows need no rotary permutation.
- Llama's gate_proj and up_proj are one `fc1` here, their rows interleaved (unit, {gate, up}).

Vocabulary rows: the checkpoints of this project pad the vocabulary to a multiple of `model.vocab_multiple`
with zero rows (networks/transformer.py); import pads, export drops the padding. Nothing here touches
the network: a folder is read from disk or written to it. Here the conversions take whole tensors (import-hf,
tests); utils/checkpoints/hf_stream.py applies them to slices (`trainer.init_from`: each rank reads its
pieces) and writes a folder a shard at a time (export-hf).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from networks.transformer import GPTConfig, LlamaConfig, padded_vocab_size
from utils import ConfigError, require
from utils.data.tokenizers import COMPANIONS

TOKENIZER_FILES = ("tokenizer.json", *COMPANIONS)
GPT2_IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older GPT-2 checkpoints
LLAMA_IGNORED = (".rotary_emb.inv_freq",)  # a buffer older Llama checkpoints saved


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


def model_settings(config: dict) -> tuple[str, dict[str, object]]:
    """(arch, model.* settings) of a Hugging Face config.json: what the project's model must be set to."""
    kind = config.get("model_type")
    if kind == "gpt2":
        activation = config.get("activation_function", "gelu_new")
        require(activation in ("gelu_new", "gelu_pytorch_tanh"), f"GPT-2 with activation {activation!r}", "DIR",
                "only the tanh-approximated GELU of GPT-2 is supported")
        require(not config.get("scale_attn_by_inverse_layer_idx") and not config.get("reorder_and_upcast_attn"),
                "GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn", "DIR",
                "only the original GPT-2 attention is supported")
        d = config["n_embd"]
        return "gpt", {"embed_dim": d, "depth": config["n_layer"], "num_heads": config["n_head"],
                       "mlp_hidden": config.get("n_inner") or 4 * d, "max_positions": config["n_positions"],
                       "norm_eps": config.get("layer_norm_epsilon", 1e-5),
                       "tie_embeddings": config.get("tie_word_embeddings", True)}
    if kind == "llama":
        d, heads = config["hidden_size"], config["num_attention_heads"]
        require(config.get("head_dim", d // heads) == d // heads, f"Llama with head_dim {config.get('head_dim')} "
                f"!= hidden_size / num_attention_heads = {d // heads}", "DIR",
                "only head_dim = hidden / heads is supported")
        require(not config.get("attention_bias") and not config.get("mlp_bias"), "Llama with biases", "DIR",
                "only Llama without attention or MLP biases is supported")
        require(config.get("hidden_act", "silu") == "silu", f"Llama with hidden_act {config.get('hidden_act')!r}",
                "DIR", "only SiLU-gated MLPs are supported")
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}  # transformers 4 | 5
        kind = rope.get("rope_type", rope.get("type", "default"))
        require(kind in ("default", "llama3"), f"Llama with rope_type {kind!r}", "DIR",
                "only the default and Llama 3.1 ('llama3') rotary frequencies are supported")
        scaling = {"rope_scaling_factor": 0.0}
        if kind == "llama3":
            scaling = {"rope_scaling_factor": float(rope["factor"]),
                       "rope_low_freq_factor": float(rope["low_freq_factor"]),
                       "rope_high_freq_factor": float(rope["high_freq_factor"]),
                       "rope_original_positions": int(rope["original_max_position_embeddings"])}
        return "llama", {"embed_dim": d, "depth": config["num_hidden_layers"], "num_heads": heads,
                         "num_kv_heads": config.get("num_key_value_heads") or heads,
                         "mlp_hidden": config["intermediate_size"], "max_positions": config["max_position_embeddings"],
                         "norm_eps": config.get("rms_norm_eps", 1e-6),
                         "rope_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))), **scaling,
                         "tie_embeddings": config.get("tie_word_embeddings", False)}
    raise ConfigError(f"config.json's model_type is {kind!r}", "DIR", "give a GPT-2 ('gpt2') or Llama ('llama') model")


def differences(model, arch: str, settings: dict[str, object]) -> list[str]:
    """The `model.key=value` settings (as overrides) in which the config `model` differs from a folder's."""
    wanted = [] if model.arch == arch else [f"model={arch}_tiny"]
    for key, value in settings.items():
        if key == "max_positions" and arch == "llama":  # rotary has no weights: the context is the run's choice
            continue
        mine = model.kv_heads if key == "num_kv_heads" else model.hidden if key == "mlp_hidden" else getattr(model, key)
        if mine != value:
            wanted.append(f"model.{key}={value}")
    return wanted


# Our names -> theirs, in a block (after "blocks.{i}." and their block prefix) and outside the blocks (GPT-2's
# without the "transformer." that transformers' GPT2LMHeadModel adds). A fused tensor of ours names its parts
# when they are separate tensors (Llama's q/k/v, gate/up); GPT-2's c_attn is itself fused.
GPT2_BLOCK = {"norm1.weight": "ln_1.weight", "norm1.bias": "ln_1.bias", "norm2.weight": "ln_2.weight",
              "norm2.bias": "ln_2.bias", "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
              "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
              "mlp.fc1.weight": "mlp.c_fc.weight", "mlp.fc1.bias": "mlp.c_fc.bias",
              "mlp.fc2.weight": "mlp.c_proj.weight", "mlp.fc2.bias": "mlp.c_proj.bias"}
GPT2_TOP = {"tok_embed.weight": "wte.weight", "pos_embed.weight": "wpe.weight", "norm.weight": "ln_f.weight",
            "norm.bias": "ln_f.bias", "lm_head.weight": "lm_head.weight"}
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")  # (in, out)
LLAMA_BLOCK = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
               "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
               "attn.proj.weight": "self_attn.o_proj.weight",
               "mlp.fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               "mlp.fc2.weight": "mlp.down_proj.weight"}
LLAMA_TOP = {"tok_embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}


def their_names(arch: str, key: str) -> tuple[str, ...]:
    """The Hugging Face tensor(s) our single-process tensor `key` is made of; () for none."""
    block, top, prefix = (GPT2_BLOCK, GPT2_TOP, "h.") if arch == "gpt" else (LLAMA_BLOCK, LLAMA_TOP, "model.layers.")
    if not key.startswith("blocks."):
        return (top[key],) if key in top else ()
    _, i, rest = key.split(".", 2)
    names = block.get(rest, ())
    return tuple(f"{prefix}{i}.{name}" for name in ((names,) if isinstance(names, str) else names))


def is_conv1d(arch: str, name: str) -> bool:
    """Whether their tensor `name` is stored (in, out): GPT-2's Conv1D weights."""
    return arch == "gpt" and name.endswith(GPT2_CONV1D)


# ----------------------------------------------------------------------------------------------- import
def _groups(num_heads: int, num_kv_heads: int) -> int:
    return num_kv_heads or num_heads


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Rows of separate projections -> the fused projection's rows (group, [q heads, k, v], head_dim)."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, groups: int, q_per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: (q, k, v) rows."""
    grouped = qkv.reshape(groups, q_per_group + 2, -1, *qkv.shape[1:])
    return tuple(part.reshape(-1, *qkv.shape[1:]).contiguous()
                 for part in (grouped[:, :q_per_group], grouped[:, q_per_group], grouped[:, q_per_group + 1]))


def to_project(arch: str, settings: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> the project's single-process state dict (vocabulary unpadded).

    Unknown, missing or misshapen tensors are refused (ConfigError) by `take`."""
    src = dict(tensors)
    if arch == "gpt":
        src = {k.removeprefix("transformer."): v for k, v in src.items() if not k.endswith(GPT2_IGNORED)}
    else:
        src = {k: v for k, v in src.items() if not k.endswith(LLAMA_IGNORED)}

    def take(name: str) -> torch.Tensor:
        require(name in src, f"the weights lack {name}", "DIR", "give the complete model folder")
        return src.pop(name).float()
    out: dict[str, torch.Tensor] = {}
    heads, groups = settings["num_heads"], _groups(settings["num_heads"], settings.get("num_kv_heads", 0))
    if arch == "gpt":
        out["tok_embed.weight"], out["pos_embed.weight"] = take("wte.weight"), take("wpe.weight")
        for i in range(settings["depth"]):
            h, b = f"h.{i}.", f"blocks.{i}."
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
                out[f"{b}{ours}.weight"] = take(f"{h}{theirs}.weight")
                out[f"{b}{ours}.bias"] = take(f"{h}{theirs}.bias")
            w, bias = take(f"{h}attn.c_attn.weight").t(), take(f"{h}attn.c_attn.bias")
            out[f"{b}attn.qkv.weight"] = fuse_qkv(*w.chunk(3), groups)
            out[f"{b}attn.qkv.bias"] = fuse_qkv(*bias.chunk(3), groups)
            for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
                out[f"{b}{ours}.weight"] = take(f"{h}{theirs}.weight").t().contiguous()
                out[f"{b}{ours}.bias"] = take(f"{h}{theirs}.bias")
        out["norm.weight"], out["norm.bias"] = take("ln_f.weight"), take("ln_f.bias")
    else:
        out["tok_embed.weight"] = take("model.embed_tokens.weight")
        for i in range(settings["depth"]):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            out[f"{b}norm1.weight"] = take(f"{h}input_layernorm.weight")
            out[f"{b}norm2.weight"] = take(f"{h}post_attention_layernorm.weight")
            out[f"{b}attn.qkv.weight"] = fuse_qkv(*(take(f"{h}self_attn.{p}_proj.weight") for p in "qkv"), groups)
            out[f"{b}attn.proj.weight"] = take(f"{h}self_attn.o_proj.weight")
            gate, up = take(f"{h}mlp.gate_proj.weight"), take(f"{h}mlp.up_proj.weight")
            out[f"{b}mlp.fc1.weight"] = torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])
            out[f"{b}mlp.fc2.weight"] = take(f"{h}mlp.down_proj.weight")
        out["norm.weight"] = take("model.norm.weight")
    if settings["tie_embeddings"]:
        src.pop("lm_head.weight", None)  # a tied head saved anyway is the embedding
        out["lm_head.weight"] = out["tok_embed.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    require(not src, f"the weights hold {len(src)} tensors a {arch} model of config.json has not "
            f"(e.g. {next(iter(src), '')})", "DIR", "check that config.json's depth and options describe these weights")
    assert heads % groups == 0
    return out


def pad_vocab(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The embedding and head with zero rows up to `rows` (a tie stays one tensor)."""
    out = dict(state)
    embed = state["tok_embed.weight"]
    padded = torch.cat([embed, embed.new_zeros(rows - len(embed), embed.shape[1])])
    out["tok_embed.weight"] = padded
    head = state["lm_head.weight"]
    out["lm_head.weight"] = (padded if head is embed
                             else torch.cat([head, head.new_zeros(rows - len(head), head.shape[1])]))
    return out


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
    arch, settings = model_settings(config)
    tensors, vocab = read_weights(folder), config["vocab_size"]
    try:
        state = to_project(arch, settings, tensors)
    except RuntimeError as err:  # a reshape of rows that config.json's heads do not divide
        raise ConfigError(f"the weights do not fit config.json ({' '.join(str(err).split())[:160]})", "DIR",
                          "give weights that match their config.json") from None
    shapes = expected_shapes(model, vocab)
    for key, shape in shapes.items():
        require(tuple(state[key].shape) == shape, f"{key} has shape {tuple(state[key].shape)}, config.json implies "
                f"{shape}", "DIR", "give weights that match their config.json")
    return pad_vocab(state, padded_vocab_size(vocab, model.vocab_multiple))


def schema_of(arch: str):
    """The model config schema of a family tag."""
    return GPTConfig if arch == "gpt" else LlamaConfig


def expected_shapes(model, vocab: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of the single-process model's state (unpadded vocabulary), built on the meta device."""
    from networks.transformer import GPT

    with torch.device("meta"):
        serial = GPT(model, vocab)
    shapes = {k: tuple(v.shape) for k, v in serial.state_dict().items()}
    rows = padded_vocab_size(vocab, model.vocab_multiple)
    return {k: (vocab, *s[1:]) if s and s[0] == rows and k in ("tok_embed.weight", "lm_head.weight") else s
            for k, s in shapes.items()}


# ----------------------------------------------------------------------------------------------- export
def hf_config(model, vocab_size: int, eos_id: int | None = None, bos_id: int | None = None,
              pad_id: int | None = None) -> dict:
    """config.json of the Hugging Face model with `model`'s settings (refused where it has no such model);
    the ids of the tokenizer's end-of-text token (generation stops at it), its beginning and padding tokens
    (None, written as null, where it has none: transformers' defaults name ids of other vocabularies)."""
    tokens = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    if model.arch == "gpt":
        fits = (model.positions == "learned" and model.norm == "layernorm" and model.mlp == "gelu" and model.bias
                and model.kv_heads == model.num_heads)
        require(fits, "this GPT's options (positions, norm, mlp, bias, num_kv_heads) are not GPT-2's", "model",
                "export a GPT with GPT-2's options, or a model=llama_* run")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
                "n_positions": model.max_positions, "n_embd": model.embed_dim, "n_layer": model.depth,
                "n_head": model.num_heads, "n_inner": model.hidden, "activation_function": "gelu_new",
                "layer_norm_epsilon": model.norm_eps, "tie_word_embeddings": model.tie_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32", **tokens}
    fits = model.positions == "rotary" and model.norm == "rmsnorm" and model.mlp == "swiglu" and not model.bias
    require(fits, "this Llama's options (positions, norm, mlp, bias) are not Llama's", "model",
            "export a Llama with rotary positions, RMSNorm, SwiGLU and no biases")
    rope = None if not model.rope_scaling_factor else {
        "rope_type": "llama3", "factor": model.rope_scaling_factor, "low_freq_factor": model.rope_low_freq_factor,
        "high_freq_factor": model.rope_high_freq_factor,
        "original_max_position_embeddings": model.rope_original_positions}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
            "hidden_size": model.embed_dim, "intermediate_size": model.hidden, "num_hidden_layers": model.depth,
            "num_attention_heads": model.num_heads, "num_key_value_heads": model.kv_heads,
            "head_dim": model.embed_dim // model.num_heads, "max_position_embeddings": model.max_positions,
            "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_base, "rope_scaling": rope,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": model.tie_embeddings, "torch_dtype": "float32", **tokens}


def hf_tensors(model, key: str, tensor: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our single-process tensor `key` (padded vocabulary) -> the Hugging Face tensors made of it (fresh,
    contiguous fp32); none for a tied head (the embedding is) or a tensor they have not. A meta `tensor`
    gives their shapes."""
    names = () if key == "lm_head.weight" and model.tie_embeddings else their_names(model.arch, key)
    if not names:
        return {}
    t = tensor.detach().float()
    if key in ("tok_embed.weight", "lm_head.weight"):
        t = t[:vocab_size]
    if ".attn.qkv." in key:
        parts = split_qkv(t, model.kv_heads, model.num_heads // model.kv_heads)
        parts = parts if len(names) == 3 else (torch.cat(parts),)  # GPT-2's c_attn: ({q, k, v}, head, hd)
    elif len(names) == 2:  # Llama's fc1: rows (unit, {gate, up})
        parts = t.reshape(-1, 2, t.shape[1]).unbind(1)
    else:
        parts = (t,)
    if model.arch == "gpt":
        names = tuple(n if n == "lm_head.weight" else f"transformer.{n}" for n in names)
    return {n: (p.t() if is_conv1d(model.arch, n) else p).contiguous().clone()
            for n, p in zip(names, parts, strict=True)}


def from_project(model, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The project's single-process state dict (padded vocabulary) -> a Hugging Face state dict."""
    return {name: t for key, tensor in state.items() for name, t in hf_tensors(model, key, tensor, vocab_size).items()}
