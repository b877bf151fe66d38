"""Per-block wrappers: activation checkpointing and torch.compile, applied to each transformer block.

Wrapping block by block (as torchtitan does) keeps compile units small and identical, so a model
compiles one block graph and reuses it, and checkpointing recomputes one block at a time in backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class CheckpointedBlock(nn.Module):
    """Runs `block` without keeping its activations; backward recomputes them (non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        if not torch.is_grad_enabled():
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False)


def wrap_blocks(model: nn.Module, *, checkpoint: bool, compile: bool) -> None:
    """Wrap every entry of `model.blocks` in place (checkpoint inside compile when both are on)."""
    for i, block in enumerate(model.blocks):
        if checkpoint:
            block = CheckpointedBlock(block)
        if compile:
            block.compile()
        model.blocks[i] = block
