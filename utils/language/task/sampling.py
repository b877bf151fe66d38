"""Sampling from the language model with a KV cache: the token choice and the decode loop of `python -m utils.generate`.

The choice (`choose`): logits / temperature, then top-k (the k likeliest tokens), then top-p (nucleus sampling,
Holtzman et al. 2020: the smallest set of likeliest tokens whose probability reaches p), then one draw from a
seeded `torch.Generator`; temperature 0 is greedy (argmax). Padding columns of the vocabulary never count.

The loop (`sample`): prompts of different lengths are padded into one batch, left or right; the model's
`Decoding` (networks/transformer.py) gives each token its position in its own text and masks the padding, so a
padded prompt continues as it does alone. With the cache, the first forward reads the prompts and each later one
only the newest token; without it (`cache=False`), each forward reads the whole text again (quadratic: the
reference the cache is checked against). A row stops at its end-of-text token; the loop when every row has.
Under tensor parallelism (`tp`, `python -m utils.generate` on several ranks) the model is this rank's shards:
each rank caches its own heads' keys and values, the vocabulary-parallel head gives each rank its vocabulary
columns of the logits, and only the last position's columns are gathered over tp (B rows, never the sequence);
every rank draws from the same gathered logits with the same seeded generator, and tp rank 0's token is
broadcast, so all ranks carry on with one text. Other layouts decode greedily with
`utils.language.task.generate.greedy_decode` (validation's samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distributed.collectives import broadcast_
from distributed.tensor.vocab import gather_vocab
from networks.transformer import Decoding
from utils import require
from utils.comm import Axis, AxisGroup, Grid

PADDINGS = ("left", "right")


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen."""

    temperature: float = 1.0  # logits are divided by it; 0: greedy (argmax)
    top_k: int = 0  # keep the k likeliest tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of likeliest tokens whose probability reaches p, in (0, 1]

    def __post_init__(self):
        require(self.temperature >= 0, f"temperature {self.temperature} is negative", "--temperature",
                "give 0 (greedy) or a positive temperature, e.g. 0.8")
        require(self.top_k >= 0, f"top-k {self.top_k} is negative", "--top-k", "give 0 (all tokens) or k >= 1")
        require(0 < self.top_p <= 1, f"top-p {self.top_p} is outside (0, 1]", "--top-p",
                "give a probability in (0, 1], e.g. 0.9 (1: all tokens)")


GREEDY = Sampling(temperature=0)


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """(..., V) bool: the smallest set of likeliest tokens whose probability sums to at least `p` (ties in
    probability broken by the sort; at least one token)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the likelier tokens
    keep_sorted = before < p  # a token is needed while the likelier ones fall short of p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) token ids drawn from `logits` (B, V) (the real vocabulary only) as `sampling` says."""
    logits = logits.float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if sampling.top_p < 1:
        probs = probs * top_p_mask(probs, sampling.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pad_prompts(prompts: list[list[int]], padding: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, P), valid (B, P) bool) of prompts padded to the longest, on the left or the right."""
    assert padding in PADDINGS and prompts and all(prompts)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if padding == "left" else slice(0, len(prompt))
        ids[row, cols], valid[row, cols] = torch.tensor(prompt), True
    return ids, valid


@torch.no_grad()
def sample(model: nn.Module, prompts: list[list[int]], new_tokens: int, sampling: Sampling, *,
           eos_id: int | None = None, seed: int = 0, cache: bool = True, padding: str = "left",
           on_logits=None, tp: AxisGroup | None = None) -> list[list[int]]:
    """The continuation of each prompt (token ids, up to its end-of-text token included, at most `new_tokens`).

    `model`: a `networks.transformer.GPT`, run in eval mode on its own device: one process's, or this rank's
    shards under tensor parallelism over `tp` (None: one process; no sequence parallelism, whose splits a
    one-token step cannot take). `on_logits(step, logits (B, V))` sees the logits each token is chosen from
    (tests compare the cached and uncached ones, and the sharded ones)."""
    tp = tp or Grid.serial().axis(Axis.TP)
    device = next(model.parameters()).device
    ids, valid = (t.to(device) for t in pad_prompts(prompts, padding))
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)  # (B,) each prompt's last real token
    generator = torch.Generator(device).manual_seed(seed)
    decoding = Decoding(valid, len(model.blocks), cache)
    out = torch.zeros(len(prompts), 0, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(ids, decoding)[torch.arange(len(prompts), device=device), last]  # (B, V_local)
        for step in range(new_tokens):
            logits = gather_vocab(logits, tp, model.padded_vocab)[:, :model.vocab_size]  # (B, V)
            if on_logits is not None:
                on_logits(step, logits)
            token = broadcast_(choose(logits, sampling, generator), tp, 0)  # (B,) tp rank 0's draw on every rank
            out = torch.cat((out, token[:, None]), dim=1)
            if eos_id is not None:
                done |= token == eos_id
            if bool(done.all()) or step == new_tokens - 1:
                break
            decoding.append(torch.ones_like(token[:, None], dtype=torch.bool))
            ids = torch.cat((ids, token[:, None]), dim=1)
            logits = model(ids[:, -1:] if cache else ids, decoding)[:, -1]
    finally:
        model.train(was_training)
    return [_until_eos(row, eos_id) for row in out.tolist()]


def _until_eos(tokens: list[int], eos_id: int | None) -> list[int]:
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens
