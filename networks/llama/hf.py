"""Llama (LlamaForCausalLM) in and out: config.json and the tensor names (networks/decoder_exchange.py)."""

from __future__ import annotations

from collections.abc import Mapping

from networks.decoder_exchange import DecoderExchange
from utils import require


class LlamaExchange(DecoderExchange):
    model_types = ("llama",)
    block = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
             "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             "attn.proj.weight": "self_attn.o_proj.weight",
             "mlp.fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
             "mlp.fc2.weight": "mlp.down_proj.weight"}
    top = {"tok_embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    block_prefix = "model.layers."
    ignored = (".rotary_emb.inv_freq",)  # a buffer older Llama checkpoints saved
    unchecked = ("max_positions",)  # rotary has no weights: the context is the run's choice

    def settings(self, config: Mapping) -> dict[str, object]:
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
        return {"embed_dim": d, "depth": config["num_hidden_layers"], "num_heads": heads,
                "num_kv_heads": config.get("num_key_value_heads") or heads,
                "mlp_hidden": config["intermediate_size"], "max_positions": config["max_position_embeddings"],
                "norm_eps": config.get("rms_norm_eps", 1e-6),
                "rope_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))), **scaling,
                "tie_embeddings": config.get("tie_word_embeddings", False)}

    def config(self, model, vocab_size: int, tokens: Mapping[str, int | None]) -> dict:
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
