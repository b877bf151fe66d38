"""Greedy decoding for the language model, on any layout: the decoder of parallel models.

Validation writes continuations with it (utils/tasks/) and the tests call it on serial and
parallel models alike; sampling with a KV cache (one process or tensor parallel) is utils/language/task/sampling.py,
whose
token choice (`choose`, greedy here) it shares.

Every step runs the model on a window of one fixed width (prompt plus new tokens, at most
`max_positions`), right-padded while it fills: the model is causal, so padding never
changes the logits of earlier positions, and a fixed width compiles one graph. Once the text is longer
than `max_positions`, the window slides and keeps the last `max_positions` tokens. Under tensor
parallelism each rank holds a vocabulary shard of the logits; the last position's shards are gathered
over tp (a few rows: training never gathers the vocabulary) and every rank picks the same token. Under
context parallelism the width is a multiple of the layout's (2 x cp), and each step gathers the logits
of every cp rank's tokens. Under pipeline parallelism `model` is the forward pass through the stages
(distributed/pipeline/schedule.py): the last stage picks the token and every pp rank receives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distributed.pipeline.schedule import from_last_stage
from distributed.tensor.vocab import gather_vocab
from utils.comm import AxisGroup
from utils.language.task.sampling import GREEDY, choose


@torch.no_grad()
def greedy_decode(model: nn.Module, prompts: torch.Tensor, new_tokens: int, *, tp: AxisGroup,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """`prompts` (B, P) followed by `new_tokens` argmax tokens: (B, P + new_tokens); never a padded id.

    `model` is a `networks.transformer.GPT`, serial or parallelized over `tp` (a size-1 axis for a
    serial model). Runs in eval mode (no dropout) and restores the previous mode.
    """
    shards = getattr(model, "context_shards", None)  # context parallelism: logits of this rank's tokens
    multiple = shards.multiple if shards is not None else 1
    width = min(-(-(prompts.shape[1] + new_tokens) // multiple) * multiple,
                model.cfg.max_positions // multiple * multiple)
    out = prompts
    was_training = model.training
    model.eval()
    try:
        for _ in range(new_tokens):
            window = out[:, -width:]
            last = window.shape[1] - 1
            with autocast():
                logits = model(F.pad(window, (0, width - window.shape[1])))  # (B, W or W_local, V_local)
            token = None if logits is None else _next_token(model, logits, last, shards, tp)
            token = from_last_stage(model, token, out[:, :1])  # pipeline: the last stage's choice
            out = torch.cat((out, token), dim=1)
    finally:
        model.train(was_training)
    return out


def _next_token(model: nn.Module, logits: torch.Tensor, last: int, shards, tp: AxisGroup) -> torch.Tensor:
    """(B, 1) argmax over the real vocabulary at position `last` of (possibly sharded) logits."""
    if shards is not None:
        logits = shards.unshard(logits, 1)  # (B, W, V_local)
    logits = gather_vocab(logits[:, last].float(), tp, model.padded_vocab)  # (B, V_padded)
    return choose(logits[:, :model.vocab_size], GREEDY)[:, None]
