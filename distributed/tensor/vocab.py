"""Vocabulary parallelism for the language model (Megatron-LM, Shoeybi et al. 2019, sec. 3).

The padded vocabulary's rows are split contiguously over tp (the tensor_split convention, so 1408 rows
over 3 ranks are 470/469/469): the embedding looks up only its rows, the tied output head produces
only its columns of the logits, and the cross-entropy combines per-token statistics over tp instead of
gathering the logits. `gather_vocab` assembles full-vocabulary logits for a few positions (greedy
decoding in validation); training never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.collectives import all_reduce, chunk_bounds, split_sizes
from distributed.mappings import gather_from_region, reduce_from_region, reduce_scatter_region
from distributed.tensor.layers import TensorParallelLayer
from utils.comm import AxisGroup


def gather_vocab(logits: torch.Tensor, tp: AxisGroup, padded_vocab: int) -> torch.Tensor:
    """(..., V_local) vocabulary shards (uneven when tp does not divide V) -> (..., V) on every tp rank."""
    return gather_from_region(logits, tp, -1, split_sizes(padded_vocab, tp.size))


class VocabParallelEmbedding(TensorParallelLayer):
    """Embedding with vocabulary ROWS split contiguously over `axis` (Megatron, Shoeybi et al. sec. 3).

    Weight (V_local, D) = rows [vocab_start, vocab_end) of the serial (padded-vocabulary) weight.
    In: token ids (B, N) replicated. Ids outside this rank's rows give zeros, so exactly one rank
    contributes each token. Out: (B, N, D) replicated, or (B, N_local, D) sequence shards under SP.
    Fwd: all-reduce, or reduce-scatter(seq_dim) under SP. Bwd: identity, or all-gather(seq_dim) under SP.
    """

    shard_dims = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, axis: AxisGroup, *, sequence_parallel: bool = False,
                 seq_dim: int = 1, padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        self.axis = axis
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.vocab_start, self.vocab_end = chunk_bounds(num_embeddings, axis)
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               device=device, dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_serial(cls, embedding: nn.Embedding, axis: AxisGroup, **kwargs) -> VocabParallelEmbedding:
        """This rank's rows of `embedding`; kwargs: sequence_parallel, seq_dim."""
        assert embedding.max_norm is None and not embedding.sparse, "max_norm/sparse embeddings are not supported"
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, axis, padding_idx=embedding.padding_idx,
                    device=w.device, dtype=w.dtype, **kwargs)
        layer.copy_shards_from(embedding)
        return layer

    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_end:
            return None
        return self.padding_idx - self.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, N)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight, self._local_padding_idx())  # (B, N, D) partial
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_region(y, self.axis, self.seq_dim)  # (B, N_local, D)
        return reduce_from_region(y, self.axis)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
                f"on {self.axis.name}={self.axis.size}, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits (Megatron `_VocabParallelCrossEntropy`).

    Fwd: all-reduce(max) of the row maxima, then one all-reduce(sum) of [sum exp, target logit].
    Bwd: no communication: grad = (softmax - onehot) * grad_loss on the local columns.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, axis: AxisGroup, vocab_start: int,
                num_valid_vocab: int | None) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        x = logits.to(torch.float32, copy=True)  # (..., V_local) fp32 like CausalLMLoss; becomes the softmax
        if num_valid_vocab is not None and num_valid_vocab < vocab_start + local_vocab:
            cols = torch.arange(vocab_start, vocab_start + local_vocab, device=x.device)
            x.masked_fill_(cols >= num_valid_vocab, float("-inf"))  # padded vocabulary columns
        x.sub_(all_reduce(x.amax(dim=-1), axis, "max").unsqueeze(-1))
        in_range = (targets >= vocab_start) & (targets < vocab_start + local_vocab)  # (...)
        local_targets = (targets - vocab_start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        x.exp_()
        sum_exp, target_logit = all_reduce(torch.stack([x.sum(dim=-1), target_logit]), axis, "sum")
        x.div_(sum_exp.unsqueeze(-1))  # softmax
        ctx.save_for_backward(x, local_targets, in_range)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit  # (...) per-token loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_targets, in_range = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: AxisGroup, *,
                                 vocab_start: int, num_valid_vocab: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy of logits (..., V_local) whose columns start at global `vocab_start`.

    Never materializes full-vocabulary logits: per token, the max, the sum of exponentials and the
    target logit are combined with all-reduces over `axis`. Columns with global index >=
    `num_valid_vocab` (vocabulary padding) are masked to -inf and targets equal to `ignore_index` do
    not count, as in the serial `CausalLMLoss`. Targets (...) are global ids, replicated over `axis`.
    """
    token_loss = _VocabParallelCrossEntropy.apply(logits, targets, axis, vocab_start, num_valid_vocab)
    counted = targets != ignore_index
    return torch.where(counted, token_loss, 0.0).sum() / counted.sum()


class VocabParallelCrossEntropy(nn.Module):
    """Criterion on logits (B, N, V_local) split over `axis` like VocabParallelEmbedding's rows.

    In: logits (B, N, V_local), targets (B, N) replicated. Out: scalar mean loss, replicated.
    Fwd: two all-reduces of (B, N)-sized tensors over `axis`. Bwd: none.
    """

    def __init__(self, axis: AxisGroup, vocab_size: int, num_valid_vocab: int | None = None,
                 ignore_index: int = -100):
        super().__init__()
        self.axis, self.vocab_size = axis, vocab_size
        self.num_valid_vocab, self.ignore_index = num_valid_vocab, ignore_index
        self.vocab_start, self.vocab_end = chunk_bounds(vocab_size, axis)

    @classmethod
    def from_serial(cls, criterion: nn.Module, axis: AxisGroup, vocab_size: int) -> VocabParallelCrossEntropy:
        """Keeps the serial criterion's `num_valid_vocab` and `ignore_index`; `vocab_size` is padded."""
        return cls(axis, vocab_size, getattr(criterion, "num_valid_vocab", None),
                   getattr(criterion, "ignore_index", -100))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert logits.shape[-1] == self.vocab_end - self.vocab_start, "logits are not this rank's vocabulary shard"
        return vocab_parallel_cross_entropy(logits, targets, self.axis, vocab_start=self.vocab_start,
                                            num_valid_vocab=self.num_valid_vocab, ignore_index=self.ignore_index)

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (B, N), replicated over `axis`, 0 at ignored targets (no backward needed:
        scoring, utils/evaluate). Same collectives as `forward`."""
        assert logits.shape[-1] == self.vocab_end - self.vocab_start, "logits are not this rank's vocabulary shard"
        loss = _VocabParallelCrossEntropy.apply(logits, targets, self.axis, self.vocab_start, self.num_valid_vocab)
        return torch.where(targets != self.ignore_index, loss, 0.0)

    def extra_repr(self) -> str:
        return (f"vocab rows [{self.vocab_start}, {self.vocab_end}) of {self.vocab_size}, "
                f"num_valid_vocab={self.num_valid_vocab}")
