"""The toy family's exchange with a Hugging Face layout (a `networks.exchange.HFAdapter`), to show that a family
outside the tree brings its own adapter from its folder and that import, sliced import and export then work with
no edit elsewhere. The layout ("toy-parallel") is this family's own, in transformers' naming style: q, k and v
apart (ours fused per head: the "qkv" rule), one norm per block, an untied head."""

from __future__ import annotations

from collections.abc import Mapping

from networks.exchange import Rule
from tests.toy_family.model import ToyConfig, ToyLM

BLOCK = {"norm.weight": "ln.weight", "norm.bias": "ln.bias", "attn.proj.weight": "attn.out_proj.weight",
         "attn.proj.bias": "attn.out_proj.bias", "mlp.fc1.weight": "mlp.fc_in.weight",
         "mlp.fc1.bias": "mlp.fc_in.bias", "mlp.fc2.weight": "mlp.fc_out.weight", "mlp.fc2.bias": "mlp.fc_out.bias"}
TOP = {"tok_embed.weight": "model.embed_tokens.weight", "pos_embed.weight": "model.embed_positions.weight",
       "norm.weight": "model.final_norm.weight", "norm.bias": "model.final_norm.bias",
       "lm_head.weight": "lm_head.weight"}
SETTINGS = {"embed_dim": "hidden_size", "depth": "num_hidden_layers", "num_heads": "num_attention_heads",
            "mlp_hidden": "intermediate_size", "max_positions": "max_position_embeddings"}


class ToyExchange:
    model_types = ("toy-parallel",)
    vocab_rows = ("tok_embed.weight", "lm_head.weight")

    def settings(self, config: Mapping) -> dict[str, object]:
        return {ours: config[theirs] for ours, theirs in SETTINGS.items()}

    def differences(self, model: ToyConfig, settings: Mapping[str, object]) -> list[str]:
        mine = {key: model.hidden if key == "mlp_hidden" else getattr(model, key) for key in settings}
        return [f"model.{key}={value}" for key, value in settings.items() if mine[key] != value]

    def config(self, model: ToyConfig, vocab_size: int, tokens: Mapping[str, int | None]) -> dict:
        values = {theirs: model.hidden if ours == "mlp_hidden" else getattr(model, ours) for ours, theirs in
                  SETTINGS.items()}
        return {"model_type": "toy-parallel", "vocab_size": vocab_size, **values, **tokens}

    def build(self, model: ToyConfig, vocab_size: int) -> ToyLM:
        return ToyLM(model, vocab_size)

    def rules(self, model: ToyConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Rule]:
        head_dim = model.embed_dim // model.num_heads
        rules = {}
        for key, shape in shapes.items():
            if key.startswith("blocks."):
                _, i, rest = key.split(".", 2)
                prefix = f"model.layers.{i}."
                if rest.startswith("attn.qkv."):  # ours: (head, {q, k, v}, head_dim); theirs: q, k, v apart
                    part = rest.rpartition(".")[2]
                    names = tuple(f"{prefix}attn.{p}_proj.{part}" for p in "qkv")
                    rules[key] = Rule("qkv", names, (0, 0, 0), False, group=(head_dim, head_dim))
                    continue
                name = prefix + BLOCK[rest]
            else:
                name = TOP[key]
            rules[key] = Rule("same", (name,), (0,), False, real_rows=shape[0])
        return rules

    def tied(self, model: ToyConfig) -> dict[str, str]:
        return {}

    def tolerated(self, model: ToyConfig) -> set[str]:
        return set()

    def stored(self, name: str) -> str | None:
        return name

    def storage(self, name: str) -> str:
        return name
