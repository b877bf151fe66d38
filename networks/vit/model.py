"""The ERA5 Vision Transformer: state at t (C x H x W) -> state at t+dt, as in the NERSC tutorial.

Patchify -> linear patch embedding + learned position embedding -> pre-norm blocks -> norm ->
linear head -> un-patchify. One definition for every layout: `distributed.tensor.parallelize` and
`distributed.context.parallelize` shard what `parallel_plan()` declares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from networks.blocks import Block, SequenceRegion
from networks.initialization import Init, initialize, linear_rules
from networks.parallel_plan import BLOCK, ParallelPlan
from utils import require


class RelativeL2Loss(nn.Module):
    """The seed's `l2_loss_opt`: mean over samples of ||pred - target||_2 / ||target||_2, each norm over
    the whole sample (C x H x W)."""

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred, target = pred.float(), target.float()
        dims = tuple(range(1, pred.dim()))  # reduced in place: no flattening copy of a permuted prediction
        num = (pred - target).pow(2).sum(dim=dims)
        den = target.pow(2).sum(dim=dims).clamp_min(1e-12)
        return (num / den).sqrt().mean()


@dataclass
class ViTConfig:
    """Schema of `model=vit_*`. Image size and channel count come from the data config."""

    arch: str = "vit"  # model family tag (fixed by the preset)
    embed_dim: int = 128  # width of the token embedding (hidden size)
    depth: int = 4  # number of transformer blocks
    num_heads: int = 4  # attention heads; must divide embed_dim (and be divisible by parallel.tp)
    patch_size: int = 8  # square patch side in grid points; must divide data.img_size
    mlp_ratio: float = 4.0  # MLP hidden = mlp_ratio * embed_dim
    dropout: float = 0.0  # dropout probability (0 keeps every layout bitwise comparable)
    init_std: float = 0.02  # std of the truncated-normal weight initialization

    def __post_init__(self):
        require(self.arch == "vit", f"arch {self.arch!r} is not a ViT", "model.arch", "leave arch as set by the preset")
        for name in ("embed_dim", "depth", "num_heads", "patch_size"):
            require(getattr(self, name) > 0, f"{name} must be positive", f"model.{name}", "set a positive integer")
        require(self.embed_dim % self.num_heads == 0,
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}",
                "model.embed_dim", "choose embed_dim a multiple of model.num_heads")
        require(0.0 <= self.dropout < 1.0, f"dropout {self.dropout} outside [0, 1)", "model.dropout",
                "set 0 <= dropout < 1")


class ViT(nn.Module):
    """Vision Transformer regressor on (B, C, H, W) fields.

    `embed` (first pipeline stage) and `output` (last) are the parts around the blocks; `PIPELINE_ENDS`
    names the attributes each uses, which a pipeline stage keeps (distributed/pipeline/stages.py).
    """

    PIPELINE_ENDS = {"embed": ("patch_embed", "pos_embed", "pos_drop", "enter_seq"),
                     "output": ("norm", "exit_seq", "head", "gather_out")}

    def __init__(self, cfg: ViTConfig, img_size: tuple[int, int], in_channels: int, out_channels: int):
        super().__init__()
        h, w = img_size
        p = cfg.patch_size
        assert h % p == 0 and w % p == 0, f"img_size {list(img_size)} is not divisible by patch_size {p} (see Config)"
        self.cfg, self.img_size, self.out_channels = cfg, (h, w), out_channels
        self.grid_hw = (h // p, w // p)
        num_patches = self.grid_hw[0] * self.grid_hw[1]
        self.patch_embed = nn.Linear(in_channels * p * p, cfg.embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, cfg.embed_dim))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.enter_seq = SequenceRegion("enter")
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, causal=False, dropout=cfg.dropout)
            for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.embed_dim)
        self.exit_seq = SequenceRegion("exit", feeds_matmul=True)  # the head
        self.head = nn.Linear(cfg.embed_dim, out_channels * p * p)
        self.gather_out = SequenceRegion("output")
        self.criterion = RelativeL2Loss()  # the seed's relative L2 loss, used by the trainer
        if not self.pos_embed.is_meta:  # a meta build is initialised shard by shard (utils/engine/materialize.py)
            initialize(self, torch.initial_seed())

    def init_rules(self) -> dict[str, Init]:
        """How every parameter starts (networks/initialization.py): truncated-normal linears (the residual
        projections scaled by 1/sqrt(2 x depth)), unit norms, a truncated-normal position table."""
        std = self.cfg.init_std
        rules = linear_rules(self, std, self.cfg.depth, self.parallel_plan().residual_projections(self))
        return rules | {"pos_embed": Init("trunc_normal", std)}

    def parallel_plan(self) -> ParallelPlan:
        """The blocks' roles; the final norm on sequence shards; embeddings and head stay whole (the head runs
        after the 'exit' gather, per token under cp)."""
        return ParallelPlan(block=BLOCK, norms=("norm",), replicated=("patch_embed", "pos_embed", "head"),
                            pipeline_ends=self.PIPELINE_ENDS)

    def num_tokens(self, x: torch.Tensor | None = None) -> int:
        """Sequence length of the blocks (patches per field), for any input."""
        return self.grid_hw[0] * self.grid_hw[1]

    def output_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """Shape of `output` (the whole field, whatever `tokens` this rank's head saw)."""
        return batch, self.out_channels, *self.img_size

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        p, (gh, gw) = self.cfg.patch_size, self.grid_hw
        b, c = x.shape[:2]
        x = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)  # (B, gh, gw, C, p, p)
        return x.reshape(b, gh * gw, c * p * p)  # (B, N, C*p*p)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        p, (gh, gw) = self.cfg.patch_size, self.grid_hw
        b = x.shape[0]
        x = x.reshape(b, gh, gw, self.out_channels, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, C, gh, p, gw, p)
        return x.reshape(b, self.out_channels, gh * p, gw * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks.children():  # a pipeline stage keeps some, under their global names
            x = block(x)
        return self.output(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Fields (B, C, H, W) -> the blocks' input (B, N_local, D): the first pipeline stage's part."""
        x = self.pos_drop(self.patch_embed(self.patchify(x)) + self.pos_embed)  # (B, N, D)
        return self.enter_seq(x)  # (B, N_local, D) under sequence parallelism

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output -> fields (B, C, H, W): the last pipeline stage's part."""
        x = self.exit_seq(self.norm(x))  # (B, N, D)
        return self.unpatchify(self.gather_out(self.head(x)))

    def stage_shape(self, batch: int, tokens: int) -> tuple[int, ...]:
        """The activation between pipeline stages for `tokens` patches on this rank: (B, N_local, D)."""
        return batch, tokens, self.cfg.embed_dim

    def attention_layers(self) -> tuple[int, int, bool]:
        """(layers, width, causal) of its attention, for the FLOPs' attention term: every block, not causal."""
        return self.cfg.depth, self.cfg.embed_dim, False

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies (for the FLOP model): all but norms, biases, pos."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
