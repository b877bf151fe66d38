"""The decoder's (networks/transformer.py) exchange with Hugging Face, shared by the GPT-2 and Llama adapters.

Both are the same computation as the decoder, so the exchange is a renaming plus three re-orderings, which the
rules (networks/exchange.py) state once for import, sliced import and export:
- GPT-2 stores its linears as Conv1D, (in, out): transposed here. Its fused c_attn orders the output features
  ({q, k, v}, head, head_dim); ours (head, {q, k, v}, head_dim), so that a contiguous split over tensor-parallel
  ranks gives whole heads.
- Llama keeps q_proj, k_proj, v_proj apart; ours is one projection ordered (kv group, [the group's query heads,
  k, v], head_dim). Query head h reads key/value head h // r in both (r = heads / kv heads), and both rotate
  (first half, second half) of each head, so the rows need no rotary permutation.
- Llama's gate_proj and up_proj are one `fc1` here, their rows interleaved (unit, {gate, up}).
A family's adapter (networks/gpt/hf.py, llama/hf.py) gives the names and reads and writes config.json.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from networks.exchange import Rule
from networks.transformer import GPT


class DecoderExchange:
    """The parts of an `networks.exchange.HFAdapter` every decoder shares; a subclass names the tensors."""

    model_types: tuple[str, ...] = ()
    vocab_rows = ("tok_embed.weight", "lm_head.weight")
    block: Mapping[str, str | tuple[str, ...]] = {}  # ours after "blocks.{i}." -> theirs (a fused tensor: its parts)
    top: Mapping[str, str] = {}  # ours outside the blocks -> theirs
    block_prefix = ""  # theirs before the block index ("h.", "model.layers.")
    conv1d: tuple[str, ...] = ()  # suffixes of their tensors stored (in, out)
    ignored: tuple[str, ...] = ()  # suffixes of their buffers older checkpoints saved
    prefix = ""  # a prefix their stored names carry, but not the head ("transformer." of GPT2LMHeadModel)
    unchecked: tuple[str, ...] = ()  # settings a folder holds that need not match (a rotary model's context)

    def build(self, model, vocab_size: int) -> nn.Module:
        return GPT(model, vocab_size)

    def tied(self, model) -> dict[str, str]:
        return {"lm_head.weight": "tok_embed.weight"} if model.tie_embeddings else {}

    def tolerated(self, model) -> set[str]:
        """Their tensors a folder may hold that are not read: a tied head saved anyway (the embedding is it)."""
        return {"lm_head.weight"} if model.tie_embeddings else set()

    def stored(self, name: str) -> str | None:
        return None if name.endswith(self.ignored) else name.removeprefix(self.prefix)

    def storage(self, name: str) -> str:
        return name if not self.prefix or name == "lm_head.weight" else self.prefix + name

    def their_names(self, key: str) -> tuple[str, ...]:
        """The Hugging Face tensor(s) our single-process tensor `key` is made of; () for none."""
        if not key.startswith("blocks."):
            return (self.top[key],) if key in self.top else ()
        _, i, rest = key.split(".", 2)
        names = self.block.get(rest, ())
        return tuple(f"{self.block_prefix}{i}.{name}" for name in ((names,) if isinstance(names, str) else names))

    def rules(self, model, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Rule]:
        head_dim, groups = model.embed_dim // model.num_heads, model.kv_heads
        q_rows = model.num_heads // groups * head_dim
        rules = {}
        for key, shape in shapes.items():
            names = self.their_names(self.tied(model).get(key, key))
            transposed = names[0].endswith(self.conv1d)
            if ".attn.qkv." in key:
                kv, total = groups * head_dim, shape[0]
                starts = (0, total - 2 * kv, total - kv) if len(names) == 1 else (0, 0, 0)
                rules[key] = Rule("qkv", names * (3 // len(names)), starts, transposed, group=(q_rows, head_dim))
            elif len(names) == 2:
                rules[key] = Rule("gate_up", names, (0, 0), transposed)
            else:
                rules[key] = Rule("same", names, (0,), transposed, real_rows=shape[0])
        return rules

    def differences(self, model, settings: Mapping[str, object]) -> list[str]:
        wanted = []
        for key, value in settings.items():
            if key in self.unchecked:
                continue
            mine = (model.kv_heads if key == "num_kv_heads" else model.hidden if key == "mlp_hidden"
                    else getattr(model, key))
            if mine != value:
                wanted.append(f"model.{key}={value}")
        return wanted
