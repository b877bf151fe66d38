"""The decoder-only language model: token ids (B, S) -> next-token logits (B, S, V_padded).

Token embedding (+ learned position embedding, or rotary inside attention) -> pre-norm causal blocks
-> final norm -> linear head over the padded vocabulary (optionally tied to the embedding).
One definition for the family; GPT-2 and Llama are two configurations of it (`model=gpt_*`: LayerNorm,
GELU MLP, biases, learned positions, tied head; `model=llama_*` (`LlamaConfig`): RMSNorm, SwiGLU, no
biases, rotary positions with a configurable base and Llama 3.1's frequency scaling, grouped-query
attention, untied head). The weights map one to one onto Hugging Face's GPT2LMHeadModel and
LlamaForCausalLM (networks/decoder_exchange.py).
Built from `networks.blocks.Block`; `parallel_plan()` declares the parts that `distributed.tensor.parallelize`
and `distributed.context.parallelize` swap. The attributes (the trainer, pipeline and decoding read them):

    tok_embed  nn.Embedding(V_padded, D)           pos_embed  nn.Embedding(max_positions, D) | None
    enter_seq  SequenceRegion('enter') after the embeddings (the sequence is split from here on)
    blocks     nn.ModuleList[Block(causal=True)]   norm       nn.LayerNorm(D) | nn.RMSNorm(D)
    lm_head    nn.Linear(D, V_padded, bias=False)  (weight is tok_embed.weight when tied)
    criterion  CausalLMLoss, with `num_valid_vocab` (columns >= it are padding and never count)

`embed` (first pipeline stage) and `output` (last) are the parts around the blocks; `PIPELINE_ENDS`
names the attributes each uses, which a pipeline stage keeps (distributed/pipeline/stages.py).

There is no 'exit' region: the head consumes the sequence region's layout directly (under tensor
sequence parallelism the vocab-parallel head all-gathers the sequence itself). Greedy decoding for
any layout is `utils.language.task.generate.greedy_decode`; sampling with a KV cache (`forward(idx, decode)`, one
process or
tensor parallel) is `utils.language.task.sampling`.
The vocabulary is padded to a multiple of `vocab_multiple` (tensor-parallel vocab splits, fast
matmuls); padding changes neither the initial weights of real tokens nor the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from networks.blocks import MLPS, NORMS, Block, DecodeStep, KVCache, Rotary, SequenceRegion, make_norm
from networks.documents import Documents, unpack_ids
from networks.initialization import Init, initialize, linear_rules
from networks.layout import check_heads
from networks.parallel_plan import BLOCK, ParallelPlan
from utils import require

POSITIONS = ("learned", "rotary")


@dataclass
class GPTConfig:
    """Schema of `model=gpt_*` (and, with other defaults, `LlamaConfig`). The vocabulary size comes from the
    data (tokenizer).

    Choices are plain `str` fields (OmegaConf structured configs do not support Literal) checked here.
    """

    arch: str = "gpt"  # model family tag (fixed by the preset)
    embed_dim: int = 128  # width of the residual stream (hidden size D)
    depth: int = 4  # number of transformer blocks
    num_heads: int = 4  # attention heads; must divide embed_dim (and be divisible by parallel.tp)
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: num_heads (multi-head attention)
    mlp: str = "gelu"  # gelu | swiglu: GPT-2's two-layer GELU MLP, or Llama's gated SiLU MLP
    mlp_ratio: float = 4.0  # MLP hidden = mlp_ratio * embed_dim (unless mlp_hidden is set)
    mlp_hidden: int = 0  # MLP hidden units; 0: mlp_ratio * embed_dim
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5  # the norms' epsilon (GPT-2 and Llama 3: 1e-5)
    bias: bool = True  # biases in the blocks' linears (GPT-2: yes; Llama: no)
    dropout: float = 0.0  # dropout probability (0 keeps every layout bitwise comparable)
    max_positions: int = 256  # longest sequence in tokens the model accepts (data.seq_len <= this)
    positions: str = "learned"  # learned | rotary: a learned position table (GPT-2) or rotary in attention
    rope_base: float = 10000.0  # rotary frequency base (theta; Llama 3: 500000)
    rope_scaling_factor: float = 0.0  # Llama 3.1 frequency scaling: 0 off, else the factor (Llama 3.2: 32)
    rope_low_freq_factor: float = 1.0  # the scaling's low-frequency factor
    rope_high_freq_factor: float = 4.0  # the scaling's high-frequency factor
    rope_original_positions: int = 8192  # the context length the scaling starts from
    tie_embeddings: bool = True  # share the output head's weight with the token embedding (GPT-2)
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (e.g. 64: tp up to 64 ranks)
    init_std: float = 0.02  # std of the weight initialization (GPT-2: 0.02)

    ARCH = "gpt"  # the tag this schema accepts (a class attribute, not a setting)

    def __post_init__(self):
        require(self.arch == self.ARCH, f"arch {self.arch!r} is not {self.ARCH}", "model.arch",
                "leave arch as set by the preset")
        for name in ("embed_dim", "depth", "num_heads", "max_positions", "vocab_multiple"):
            require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}",
                    f"model.{name}", "set a positive integer")
        require(self.embed_dim % self.num_heads == 0,
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}",
                "model.embed_dim", "choose embed_dim a multiple of model.num_heads")
        require(self.num_kv_heads >= 0 and self.num_heads % self.kv_heads == 0,
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}",
                "model.num_kv_heads", "choose a divisor of model.num_heads (0: as many as num_heads)")
        require(self.mlp_ratio > 0, f"mlp_ratio must be positive, got {self.mlp_ratio}", "model.mlp_ratio",
                "set a positive ratio, e.g. 4")
        require(self.mlp_hidden >= 0, f"mlp_hidden must be >= 0, got {self.mlp_hidden}", "model.mlp_hidden",
                "set 0 (mlp_ratio x embed_dim) or a positive number of units")
        for name, choices in (("mlp", MLPS), ("norm", NORMS), ("positions", POSITIONS)):
            require(getattr(self, name) in choices, f"unknown {name} {getattr(self, name)!r}", f"model.{name}",
                    f"choose one of {', '.join(choices)}")
        require(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}", "model.norm_eps",
                "set e.g. 1e-5")
        require(0.0 <= self.dropout < 1.0, f"dropout {self.dropout} outside [0, 1)", "model.dropout",
                "set 0 <= dropout < 1")
        require(self.positions != "rotary" or (self.embed_dim // self.num_heads) % 2 == 0,
                f"rotary positions need an even head_dim, got {self.embed_dim // self.num_heads}",
                "model.positions", "use positions=learned or an embed_dim/num_heads that is even")
        require(self.rope_base > 1, f"rope_base must be > 1, got {self.rope_base}", "model.rope_base",
                "set e.g. 10000 (GPT-NeoX) or 500000 (Llama 3)")
        require(self.rope_scaling_factor == 0 or (self.rope_scaling_factor >= 1
                and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor and self.rope_original_positions > 0),
                f"rope scaling factor {self.rope_scaling_factor}, low/high frequency factors "
                f"{self.rope_low_freq_factor}/{self.rope_high_freq_factor}, "
                f"original positions {self.rope_original_positions}",
                "model.rope_scaling_factor", "set 0 (off), or a factor >= 1 with 0 < low < high frequency factors")
        require(self.init_std > 0, f"init_std must be positive, got {self.init_std}", "model.init_std",
                "set a positive std, e.g. 0.02")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads for multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def hidden(self) -> int:
        """MLP hidden units."""
        return self.mlp_hidden or int(self.embed_dim * self.mlp_ratio)

    def rotary(self) -> Rotary | None:
        """The rotary embedding these settings ask for (None with learned positions)."""
        if self.positions != "rotary":
            return None
        scaling = None if not self.rope_scaling_factor else (
            self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
            self.rope_original_positions)
        return Rotary(self.max_positions, self.rope_base, scaling)


@dataclass
class LlamaConfig(GPTConfig):
    """Schema of `model=llama_*`: the same decoder with Llama's choices as defaults (RMSNorm, SwiGLU, no
    biases, rotary with base 500000, untied head). Llama 3.2 1B: embed_dim 2048, depth 16, 32 heads, 8 kv
    heads, mlp_hidden 8192, tied, rope scaling factor 32; Llama 3.1 8B: 4096, 32, 32, 8, 14336, untied, 8."""

    arch: str = "llama"
    num_kv_heads: int = 2
    mlp: str = "swiglu"
    mlp_hidden: int = 344
    norm: str = "rmsnorm"
    bias: bool = False
    positions: str = "rotary"
    rope_base: float = 500000.0
    tie_embeddings: bool = False

    ARCH = "llama"


def padded_vocab_size(vocab: int, multiple: int) -> int:
    """`vocab` rounded up to a multiple of `multiple`."""
    assert vocab > 0 and multiple > 0
    return -(-vocab // multiple) * multiple


def check_layout(cfg: GPTConfig, parallel) -> None:
    """The layouts the decoder refuses (its family's `check_layout`): heads over tp and cp; key/value heads split
    over tp when tp divides them, kept whole (each rank its queries' group) when they divide tp; a gated MLP's units
    whole on one tp rank."""
    tp = parallel.tp
    check_heads(cfg.num_heads, parallel)
    require(cfg.kv_heads % tp == 0 or tp % cfg.kv_heads == 0,
            f"model.num_kv_heads={cfg.kv_heads} with parallel.tp={tp}: key/value heads are split over tp when tp "
            "divides them and kept whole (each rank its queries' group) when they divide tp", "parallel.tp",
            f"choose a parallel.tp that divides or is a multiple of {cfg.kv_heads}")
    require(cfg.mlp != "swiglu" or cfg.hidden % tp == 0, f"model.mlp_hidden={cfg.hidden} is not divisible by "
            f"parallel.tp={tp} (the gated MLP keeps each unit's gate and up rows on one rank)", "model.mlp_hidden",
            f"choose a multiple of {tp}")


def check_seq_len(cfg: GPTConfig, seq_len: int) -> None:
    """User error when the data's sequence length does not fit the model's position range."""
    require(seq_len <= cfg.max_positions, f"seq_len {seq_len} exceeds model.max_positions {cfg.max_positions}",
            "data.seq_len", f"set data.seq_len <= {cfg.max_positions} or raise model.max_positions")


class CausalLMLoss(nn.Module):
    """Mean next-token cross-entropy over all tokens; vocabulary padding columns are masked out.

    Dropping the columns >= num_valid_vocab before the softmax equals masking them to -inf: they get
    zero probability and zero gradient, so the loss does not depend on the padded size. Computed in
    float32. Targets equal to `ignore_index` do not count.
    """

    def __init__(self, num_valid_vocab: int, ignore_index: int = -100):
        super().__init__()
        self.num_valid_vocab, self.ignore_index = num_valid_vocab, ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits[..., :self.num_valid_vocab].float()  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index)


class Decoding:
    """Generation's state beside the model: which tokens of each row's text are real (padding is not), and the
    blocks' key/value caches (None: every forward sees the whole text).

    A token's position counts the real tokens before it in its row, so a padded prompt (left, right, or padding
    between a prompt and its continuation) has the positions it has alone; a token attends the real tokens up to
    itself, and itself (a padding query's row is never empty; its output is never used).
    """

    def __init__(self, valid: torch.Tensor, depth: int, cache: bool = True):
        self.valid = valid  # (B, T) bool: real tokens of the text so far
        self.caches = [KVCache() for _ in range(depth)] if cache else None

    def append(self, valid: torch.Tensor) -> None:
        """Mark the next tokens (B, N) real or not, before the forward that reads them."""
        self.valid = torch.cat((self.valid, valid), dim=1)

    def step(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions (B, new), mask (B, 1, new, T)) of the last `new` tokens of the text."""
        total = self.valid.shape[1]
        positions = (self.valid.long().cumsum(1) - 1).clamp_min(0)[:, total - new:]
        query = torch.arange(total - new, total, device=self.valid.device)[:, None]  # (new, 1)
        key = torch.arange(total, device=self.valid.device)[None]  # (1, T)
        mask = ((key <= query) & self.valid[:, None, :]) | (key == query)  # (B, new, T)
        return positions, mask[:, None]


class GPT(nn.Module):
    """Decoder-only pre-norm transformer language model."""

    PIPELINE_ENDS = {"embed": ("tok_embed", "pos_embed", "embed_drop", "enter_seq"), "output": ("norm", "lm_head")}

    def __init__(self, cfg: GPTConfig, vocab_size: int, documents: str | None = None):
        """`documents`: None (rows cut from one stream), or rows packed from whole documents whose token ids carry
        the document starts (networks/documents.py) with 'causal' (positions reset per document) or 'document'
        attention (also masked to each document)."""
        super().__init__()
        assert documents in (None, "causal", "document"), documents
        self.documents = documents
        require(vocab_size > 0, f"the tokenizer has {vocab_size} tokens", "data.tokenizer",
                "use a corpus and tokenizer with a non-empty vocabulary")
        self.cfg, self.vocab_size = cfg, vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, cfg.vocab_multiple)
        d = cfg.embed_dim
        self.tok_embed = nn.Embedding(self.padded_vocab, d)
        self.pos_embed = nn.Embedding(cfg.max_positions, d) if cfg.positions == "learned" else None
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.enter_seq = SequenceRegion("enter")
        self.blocks = nn.ModuleList(
            Block(d, cfg.num_heads, causal=True, dropout=cfg.dropout, bias=cfg.bias, rotary=cfg.rotary(),
                  num_kv_heads=cfg.kv_heads, norm=cfg.norm, mlp=cfg.mlp, mlp_hidden=cfg.hidden, norm_eps=cfg.norm_eps)
            for _ in range(cfg.depth))
        self.norm = make_norm(cfg.norm, d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, self.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight
        self.criterion = CausalLMLoss(vocab_size)
        # a meta build is initialised shard by shard (utils/engine/materialize.py)
        if not self.tok_embed.weight.is_meta:
            initialize(self, torch.initial_seed())

    def init_rules(self) -> dict[str, Init]:
        """How every parameter starts (networks/initialization.py): normal token rows (padded rows zero) and
        position table, the blocks' truncated-normal linears (residual projections scaled by 1/sqrt(2 x depth))
        and unit norms, a truncated-normal head over the real vocabulary, or the embedding's values when tied
        (a pipeline's last stage holds the tied head apart: it draws the embedding's stream)."""
        std, vocab = self.cfg.init_std, self.vocab_size
        rules = linear_rules(self, std, self.cfg.depth, self.parallel_plan().residual_projections(self))
        rules["tok_embed.weight"] = Init("normal", std, valid_rows=vocab)
        rules["lm_head.weight"] = Init("normal", std, vocab, key="tok_embed.weight") if self.cfg.tie_embeddings \
            else Init("trunc_normal", std, valid_rows=vocab)
        return rules

    def parallel_plan(self) -> ParallelPlan:
        """The blocks' roles; the final norm on sequence shards; vocabulary-parallel embedding, head and loss."""
        return ParallelPlan(block=BLOCK, norms=("norm",), replicated=("pos_embed",), vocab_embedding="tok_embed",
                            vocab_head="lm_head", pipeline_ends=self.PIPELINE_ENDS)

    def forward(self, idx: torch.Tensor, decode: Decoding | None = None) -> torch.Tensor:
        """Logits of `idx` (B, S); `decode` (generation only): `idx` are the newest tokens of texts whose earlier
        tokens the caches hold (or the whole texts, without caches), their padding masked."""
        if decode is not None:
            return self._decode(idx, decode)
        x = self.embed(idx)
        documents = self.read_documents(idx)
        for block in self.blocks.children():  # a pipeline stage keeps some, under their global names
            x = block(x) if documents is None else block(x, documents=documents)
        return self.output(x)

    def read_documents(self, idx: torch.Tensor) -> Documents | None:
        """The documents of packed ids `idx` (B, S), None for rows cut from one stream (every stage reads them
        from the batch's ids: they travel with each micro-batch, distributed/pipeline/)."""
        return None if self.documents is None else Documents.read(idx, self.documents == "document")

    def _decode(self, idx: torch.Tensor, decode: Decoding) -> torch.Tensor:
        positions, mask = decode.step(idx.shape[1])
        x = self.embed(idx, positions)
        caches = decode.caches or [None] * len(self.blocks)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, DecodeStep(positions, mask, cache))
        return self.output(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, S) -> the blocks' input (B, S_local, D): the first pipeline stage's part. `positions`
        (B, S): each token's position (generation); by default 0 .. S-1, or in its document for packed ids."""
        if self.documents is not None:
            idx, starts = unpack_ids(idx)
            if positions is None and self.pos_embed is not None:
                positions = Documents(starts, masked=False).positions
        seq_len = idx.shape[1]
        if seq_len > self.cfg.max_positions:
            check_seq_len(self.cfg, seq_len)
        x = self.tok_embed(idx)  # (B, S, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq_len, device=idx.device) if positions is None else positions)
        return self.enter_seq(self.embed_drop(x))  # (B, S_local, D) under sequence parallelism

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output -> logits (B, S_local, V_padded): the last pipeline stage's part."""
        return self.lm_head(self.norm(x))

    def num_tokens(self, idx: torch.Tensor) -> int:
        """Sequence length of the blocks for input `idx` (B, S)."""
        return idx.shape[1]

    def output_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """Shape of `output` for `tokens` tokens reaching the head (the rank's vocabulary rows)."""
        return batch, tokens, self.lm_head.weight.shape[0]

    def stage_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """The activation between pipeline stages for `tokens` tokens on this rank: (B, S_local, D)."""
        return batch, tokens, self.cfg.embed_dim

    def attention_layers(self) -> tuple[int, int, bool]:
        """(layers, width, causal) of its attention, for the FLOPs' attention term: every block, causal."""
        return self.cfg.depth, self.cfg.embed_dim, True

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `idx` (B, S) against `targets` (B, S)."""
        return self.criterion(self(idx), targets)

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies (for the FLOP model): every linear, with the
        (padded) output head counted once even when tied; embedding lookups, norms, biases excluded."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
