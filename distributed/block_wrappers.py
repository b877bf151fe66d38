"""Per-block wrappers: activation checkpointing and torch.compile, applied to each transformer block.

Wrapping block by block (as torchtitan does) keeps compile units small and identical, so a model
compiles one block graph and reuses it, and checkpointing recomputes one block at a time in backward.
With both on, dynamo traces the (non-reentrant) checkpoint as part of the block: still one graph.
The tensor-parallel mappings trace without graph breaks (tests/test_compile.py); a new grad mode,
autocast state or input shape compiles another graph. Collectives inside compiled blocks are counted
like eager ones (`dlscale::add_bytes` in distributed/counting.py), except the ones the compiled
backward re-runs for activation checkpointing.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def wrap_blocks(model: nn.Module, *, checkpoint: bool, compile: bool) -> None:
    """Wrap every entry of `model.blocks` in place (checkpoint inside compile when both are on).

    torch's checkpoint_wrapper (non-reentrant) keeps parameter and state-dict names unchanged, so a
    checkpoint written with activation checkpointing on loads with it off and the other way round.
    """
    for name, block in list(model.blocks.named_children()):  # a pipeline stage's blocks keep global names
        if checkpoint:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compile:
            block.compile()
        setattr(model.blocks, name, block)
