"""GPT-2 (GPT2LMHeadModel) in and out: config.json and the tensor names (networks/decoder_exchange.py)."""

from __future__ import annotations

from collections.abc import Mapping

from networks.decoder_exchange import DecoderExchange
from utils import require


class GPT2Exchange(DecoderExchange):
    model_types = ("gpt2",)
    block = {"norm1.weight": "ln_1.weight", "norm1.bias": "ln_1.bias", "norm2.weight": "ln_2.weight",
             "norm2.bias": "ln_2.bias", "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
             "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
             "mlp.fc1.weight": "mlp.c_fc.weight", "mlp.fc1.bias": "mlp.c_fc.bias",
             "mlp.fc2.weight": "mlp.c_proj.weight", "mlp.fc2.bias": "mlp.c_proj.bias"}
    top = {"tok_embed.weight": "wte.weight", "pos_embed.weight": "wpe.weight", "norm.weight": "ln_f.weight",
           "norm.bias": "ln_f.bias", "lm_head.weight": "lm_head.weight"}
    block_prefix = "h."
    conv1d = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    ignored = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older GPT-2 checkpoints
    prefix = "transformer."

    def settings(self, config: Mapping) -> dict[str, object]:
        activation = config.get("activation_function", "gelu_new")
        require(activation in ("gelu_new", "gelu_pytorch_tanh"), f"GPT-2 with activation {activation!r}", "DIR",
                "only the tanh-approximated GELU of GPT-2 is supported")
        require(not config.get("scale_attn_by_inverse_layer_idx") and not config.get("reorder_and_upcast_attn"),
                "GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn", "DIR",
                "only the original GPT-2 attention is supported")
        d = config["n_embd"]
        return {"embed_dim": d, "depth": config["n_layer"], "num_heads": config["n_head"],
                "mlp_hidden": config.get("n_inner") or 4 * d, "max_positions": config["n_positions"],
                "norm_eps": config.get("layer_norm_epsilon", 1e-5),
                "tie_embeddings": config.get("tie_word_embeddings", True)}

    def config(self, model, vocab_size: int, tokens: Mapping[str, int | None]) -> dict:
        fits = (model.positions == "learned" and model.norm == "layernorm" and model.mlp == "gelu" and model.bias
                and model.kv_heads == model.num_heads)
        require(fits, "this GPT's options (positions, norm, mlp, bias, num_kv_heads) are not GPT-2's", "model",
                "export a GPT with GPT-2's options, or a model=llama_* run")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
                "n_positions": model.max_positions, "n_embd": model.embed_dim, "n_layer": model.depth,
                "n_head": model.num_heads, "n_inner": model.hidden, "activation_function": "gelu_new",
                "layer_norm_epsilon": model.norm_eps, "tie_word_embeddings": model.tie_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32", **tokens}
