"""Log-likelihood scoring of multiple-choice items (how zero-shot benchmarks score a language model).

A choice's score is the summed log-probability of its tokens given the context and the choice's earlier tokens,
read from one forward of the whole sequence; `normalize` divides it by the choice's token count (`length`) or
its UTF-8 bytes (`bytes`), or leaves it (`sum`). The item's prediction is its best-scoring choice; accuracy
comes with its standard error sqrt(p (1 - p) / n).

Batches: requests sorted by length (longest first), `batch` at a time, right-padded (a causal model's logits
at a position never see the padding after it); the padding's targets are ignored. The model is the one training
runs: serial, or this rank's part under tensor parallelism (the vocabulary-parallel criterion's per-token
losses: logits are never gathered) and pipeline parallelism (the forward pass through the stages; the last
stage's sums reach every pp rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distributed.pipeline.schedule import from_last_stage
from distributed.tensor.vocab import VocabParallelCrossEntropy
from utils.evaluate.items import Item, Request

NORMALIZE = ("sum", "length", "bytes")
IGNORE = -100  # the criterion's ignore_index: padding targets


@dataclass
class Result:
    accuracy: float
    stderr: float  # sqrt(p (1 - p) / n)
    num_items: int
    per_item: list[dict]  # {"line", "answer", "predicted", "scores"}


@torch.no_grad()
def log_likelihoods(model: nn.Module, requests: list[Request], batch: int, device: torch.device,
                    width_multiple: int = 1) -> list[float]:
    """The summed log-probability of each request's scored tokens, in the requests' order (float64 sums)."""
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r].ids))
    out = [0.0] * len(requests)
    for start in range(0, len(order), batch):
        chunk = [requests[r] for r in order[start:start + batch]]
        x, y = padded(chunk, width_multiple)
        x, y = x.to(device), y.to(device)
        logits = model(x)  # (B, W, V or V_local); None off a pipeline's last stage
        sums = None if logits is None else -token_losses(model.criterion, logits, y).double().sum(dim=1)
        sums = from_last_stage(model, sums, torch.zeros(len(chunk), dtype=torch.float64, device=device))
        for r, value in zip(order[start:start + batch], sums.tolist(), strict=True):
            out[r] = value
    return out


def padded(chunk: list[Request], multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, W) right-padded with id 0 and targets (B, W): the scored tokens, IGNORE elsewhere. W: the
    longest input rounded up to `multiple` (sequence splits under tensor parallelism)."""
    width = -(-max(len(r.ids) - 1 for r in chunk) // multiple) * multiple
    x = torch.zeros(len(chunk), width, dtype=torch.long)
    y = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
    for row, r in enumerate(chunk):
        n = len(r.ids) - 1
        x[row, :n] = torch.tensor(r.ids[:-1])
        y[row, n - r.num_scored:n] = torch.tensor(r.ids[-r.num_scored:])
    return x, y


def token_losses(criterion: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, W) negative log-likelihood of each target (0 where ignored), computed in float32 as the training
    loss is: the vocabulary-parallel criterion's per-token losses under tp, the serial one's otherwise."""
    if isinstance(criterion, VocabParallelCrossEntropy):
        return criterion.token_losses(logits, targets)
    logits = logits[..., :criterion.num_valid_vocab].float()  # padded vocabulary columns never count
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


def choice_scores(items: list[Item], requests: list[Request], loglik: list[float], normalize: str) -> list[list[float]]:
    """Each item's choice scores: the log-likelihood, per token (`length`) or per UTF-8 byte (`bytes`)."""
    scores = [[0.0] * len(item.choices) for item in items]
    for r, value in zip(requests, loglik, strict=True):
        if normalize == "length":
            value /= r.num_scored
        elif normalize == "bytes":
            value /= len(items[r.item].choices[r.choice].encode("utf-8"))
        scores[r.item][r.choice] = value
    return scores


def summarize(items: list[Item], scores: list[list[float]]) -> Result:
    """Accuracy (the first best choice on ties), its standard error and the per-item rows."""
    rows = []
    for item, s in zip(items, scores, strict=True):
        rows.append({"line": item.line, "answer": item.answer, "predicted": max(range(len(s)), key=s.__getitem__),
                     "scores": s})
    n = len(rows)
    p = sum(r["predicted"] == r["answer"] for r in rows) / n
    return Result(p, math.sqrt(p * (1 - p) / n), n, rows)
