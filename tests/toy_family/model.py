"""A tests-only model family: a decoder whose blocks run attention and the MLP side by side from one norm,
x + attn(norm(x)) + mlp(norm(x)) (GPT-J, PaLM), with an untied head. It exists to show that a family is its
own folder, a family module (tests/toy_family/__init__.py: FAMILY and PRESETS) found by DLSCALE_FAMILIES or an
entry point: nothing outside this folder names it, and it trains under tp, cp and pp like the built-in families
(tests/test_toy_family.py, tests/test_family_discovery.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from networks.blocks import MLP, Attention, SequenceRegion
from networks.initialization import Init, initialize, linear_rules
from networks.parallel_plan import BlockPlan, ParallelPlan
from networks.transformer import CausalLMLoss, GPTConfig, check_seq_len, padded_vocab_size


@dataclass
class ToyConfig(GPTConfig):
    """Schema of `model=toy_tiny`: the decoder settings it reads (embed_dim, depth, num_heads, mlp_ratio,
    max_positions, vocab_multiple, init_std); learned positions and LayerNorm always."""

    arch: str = "toy"
    embed_dim: int = 64
    depth: int = 2

    ARCH = "toy"


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)): attention and MLP side by side from one pre-norm."""

    def __init__(self, dim: int, num_heads: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, causal=True)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


BLOCK = BlockPlan(attention=("attn",), column=("attn.qkv", "mlp.fc1"), row=("attn.proj", "mlp.fc2"),
                  norms=("norm",), dropouts=("mlp.drop",))


class ToyLM(nn.Module):
    """The toy decoder: token and position embeddings, parallel blocks, a final norm and an untied head."""

    PIPELINE_ENDS = {"embed": ("tok_embed", "pos_embed", "enter_seq"), "output": ("norm", "lm_head")}  # noqa: RUF012

    def __init__(self, cfg: ToyConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        padded, d = padded_vocab_size(vocab_size, cfg.vocab_multiple), cfg.embed_dim
        self.padded_vocab = padded  # what decoding reads of a language model (networks/spec.py)
        self.tok_embed = nn.Embedding(padded, d)
        self.pos_embed = nn.Embedding(cfg.max_positions, d)
        self.enter_seq = SequenceRegion("enter")
        self.blocks = nn.ModuleList(ParallelBlock(d, cfg.num_heads, cfg.hidden) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, padded, bias=False)
        self.criterion = CausalLMLoss(vocab_size)
        if not self.tok_embed.weight.is_meta:
            initialize(self, torch.initial_seed())

    def init_rules(self) -> dict[str, Init]:
        std = self.cfg.init_std
        rules = linear_rules(self, std, self.cfg.depth, self.parallel_plan().residual_projections(self))
        return rules | {"tok_embed.weight": Init("normal", std, valid_rows=self.vocab_size),
                        "lm_head.weight": Init("trunc_normal", std, valid_rows=self.vocab_size)}

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(block=BLOCK, norms=("norm",), replicated=("pos_embed",), vocab_embedding="tok_embed",
                            vocab_head="lm_head", pipeline_ends=self.PIPELINE_ENDS)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks.children():
            x = block(x)
        return self.output(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.cfg.max_positions:
            check_seq_len(self.cfg, idx.shape[1])
        x = self.tok_embed(idx) + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        return self.enter_seq(x)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def num_tokens(self, idx: torch.Tensor) -> int:
        return idx.shape[1]

    def output_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        return batch, tokens, self.lm_head.weight.shape[0]

    def stage_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        return batch, tokens, self.cfg.embed_dim

    def attention_layers(self) -> tuple[int, int, bool]:
        return self.cfg.depth, self.cfg.embed_dim, True

    def matmul_params(self) -> int:
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
