"""Tensor-parallel layers (Megatron-LM) with optional sequence parallelism, built from serial layers.

Every layer receives the `AxisGroup` it is split over in its constructor and declares its layout:
- `shard_dims`: parameter name -> tensor dim split contiguously over `axis` (torch.tensor_split
  convention: the first ranks get one more row when the split is uneven). Parameters not listed are
  replicated over `axis`.
- `partial_grad_axes`: axes over which the gradients of `partial_grad_params()` (replicated weights)
  are partial sums; `distributed.data_parallel.sync_partial_grads` sums them. That is the LayerNorm
  under sequence parallelism and the row-parallel bias under sequence parallelism: each rank only
  sees its own tokens.

`from_serial(module, axis, ...)` copies this rank's shard of the full serial weights, so the initial
full weights do not depend on the layout. Shapes: B batch, N sequence, N_local = N split over tp.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from distributed.mappings import (all_gather_region, all_reduce_tensor, copy_to_region, gather_from_region,
                                  reduce_from_region, reduce_scatter_region, scatter_to_region, split_sizes)
from utils.comm import AxisGroup


def shard(tensor: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk (tensor_split convention) of a full tensor, as a new tensor."""
    return tensor.detach().tensor_split(axis.size, dim=dim)[axis.rank].clone()


def shard_range(length: int, axis: AxisGroup) -> tuple[int, int]:
    """[start, end) of this rank's chunk of `length` rows split over `axis`."""
    sizes = split_sizes(length, axis.size)
    start = sum(sizes[: axis.rank])
    return start, start + sizes[axis.rank]


class SequenceShards:
    """Per-rank sequence lengths inside one sequence-parallel region, shared by its layers.

    An all-gather along the sequence cannot infer the other ranks' lengths when N is not divisible
    by tp (e.g. 4050 ViT patches over 4 ranks), so the region's entry records the full length here
    and every sequence-parallel layer of the region reads it. Without a recorded length (a pipeline
    stage that does not contain the entry), the split is assumed even.
    """

    def __init__(self, axis: AxisGroup):
        self.axis = axis
        self.sizes: list[int] | None = None

    def enter(self, length: int) -> None:
        self.sizes = split_sizes(length, self.axis.size)


class TensorParallelLayer(nn.Module):
    """Base of the parallel layers: the axis they are split over and their layout declarations.

    Subclasses set `self.axis` in their constructor. `sharded_params`/`shard_axis` are what
    `distributed.grad_norm` reads; `shard_dims` adds the split dim for resharding checkpoints.
    """

    axis: AxisGroup
    shard_dims: ClassVar[dict[str, int]] = {}  # parameter name -> dim split over `axis`; never mutated
    partial_grad_axes: tuple[str, ...] = ()  # axes over which partial_grad_params() grads are partial

    @property
    def sharded_params(self) -> tuple[str, ...]:
        return tuple(name for name in self.shard_dims if getattr(self, name, None) is not None)

    @property
    def shard_axis(self) -> str:
        return self.axis.name

    def partial_grad_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradients are partial sums over `partial_grad_axes`."""
        return []

    @torch.no_grad()
    def copy_shards_from(self, serial: nn.Module) -> None:
        """Fill each parameter from the same-named FULL parameter of `serial`: this rank's chunk along
        its `shard_dims` entry, or the whole tensor when it is replicated."""
        for name, param in self.named_parameters(recurse=False):
            full = getattr(serial, name)
            param.copy_(shard(full, self.axis, self.shard_dims[name]) if name in self.shard_dims else full)


def _init_uniform(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default init with the FULL fan-in (for standalone use; from_serial overwrites it)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


class ParallelLinear(TensorParallelLayer):
    """Base of the column- and row-parallel linears: built from a serial nn.Linear."""

    @classmethod
    def from_serial(cls, linear: nn.Linear, axis: AxisGroup, **kwargs) -> ParallelLinear:
        """This rank's shard of `linear` (rows for column-, columns for row-parallel; see shard_dims);
        kwargs go to the constructor (gather_output, input_is_parallel, sequence_parallel, seq_dim, shards)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, axis, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **kwargs)
        layer.copy_shards_from(linear)
        return layer


class ColumnParallelLinear(ParallelLinear):
    """Linear with OUT features split over `axis` (Megatron column parallelism, Shoeybi et al. fig. 3).

    Weight (out_local, in) = rows of the serial weight; bias (out_local) likewise.
    In: (B, N, in) replicated, or (B, N_local, in) sequence shards when `sequence_parallel`.
    Out: (B, N, out_local); (B, N, out) replicated when `gather_output`.
    Fwd: identity, or all-gather(seq_dim) under SP; then all-gather(features) if `gather_output`.
    Bwd: all-reduce of the input gradient, or reduce-scatter(seq_dim) under SP.
    """

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, axis: AxisGroup, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 shards: SequenceShards | None = None, device=None, dtype=None):
        super().__init__()
        self.axis = axis
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.seq_dim, self.shards = seq_dim, shards
        self.out_sizes = split_sizes(out_features, axis.size)
        local = self.out_sizes[axis.rank]
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            sizes = self.shards.sizes if self.shards is not None else None
            x = all_gather_region(x, self.axis, self.seq_dim, sizes)  # (B, N, in)
        else:
            x = copy_to_region(x, self.axis)
        y = F.linear(x, self.weight, self.bias)  # (B, N, out_local)
        return gather_from_region(y, self.axis, -1, self.out_sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} split over {self.axis.name}={self.axis.size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(ParallelLinear):
    """Linear with IN features split over `axis` (Megatron row parallelism, Shoeybi et al. fig. 3).

    Weight (out, in_local) = columns of the serial weight; bias (out) replicated, added once after
    the reduction. In: (B, N, in_local) (`input_is_parallel`), else (B, N, in) replicated and split here.
    Out: (B, N, out) replicated, or (B, N_local, out) sequence shards under SP.
    Fwd: all-reduce, or reduce-scatter(seq_dim) under SP. Bwd: identity, or all-gather(seq_dim) under SP.
    Under SP the bias sees only local tokens: its gradient is partial over `axis` (declared).
    """

    shard_dims = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, axis: AxisGroup, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.axis = axis
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        self.partial_grad_axes = (axis.name,) if sequence_parallel and bias else ()
        local = split_sizes(in_features, axis.size)[axis.rank]
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [self.bias] if self.partial_grad_axes else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.axis, -1)  # (B, N, in_local)
        y = F.linear(x, self.weight)  # (B, N, out) partial sums over axis
        if self.sequence_parallel:
            y = reduce_scatter_region(y, self.axis, self.seq_dim)  # (B, N_local, out)
        else:
            y = reduce_from_region(y, self.axis)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} split over {self.axis.name}={self.axis.size}, out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


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
        self.vocab_start, self.vocab_end = shard_range(num_embeddings, axis)
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
        x.sub_(all_reduce_tensor(x.amax(dim=-1), axis, "max").unsqueeze(-1))
        in_range = (targets >= vocab_start) & (targets < vocab_start + local_vocab)  # (...)
        local_targets = (targets - vocab_start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        x.exp_()
        sum_exp, target_logit = all_reduce_tensor(torch.stack([x.sum(dim=-1), target_logit]), axis, "sum")
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
        self.vocab_start, self.vocab_end = shard_range(vocab_size, axis)

    @classmethod
    def from_serial(cls, criterion: nn.Module, axis: AxisGroup, vocab_size: int) -> VocabParallelCrossEntropy:
        """Keeps the serial criterion's `num_valid_vocab` and `ignore_index`; `vocab_size` is padded."""
        return cls(axis, vocab_size, getattr(criterion, "num_valid_vocab", None),
                   getattr(criterion, "ignore_index", -100))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert logits.shape[-1] == self.vocab_end - self.vocab_start, "logits are not this rank's vocabulary shard"
        return vocab_parallel_cross_entropy(logits, targets, self.axis, vocab_start=self.vocab_start,
                                            num_valid_vocab=self.num_valid_vocab, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return (f"vocab rows [{self.vocab_start}, {self.vocab_end}) of {self.vocab_size}, "
                f"num_valid_vocab={self.num_valid_vocab}")


class SequenceParallelLayerNorm(nn.LayerNorm, TensorParallelLayer):
    """LayerNorm on sequence shards (Korthikanti et al. 2022, sec. 4.2.2).

    Weight and bias (D) replicated over `axis`; in/out (B, N_local, D). No communication in forward
    or backward: normalization is per token. Each rank sees only its tokens, so the weight and bias
    gradients are partial sums over `axis` (declared by `partial_grad_axes`).
    """

    def __init__(self, normalized_shape, axis: AxisGroup, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.axis = axis
        self.partial_grad_axes = (axis.name,)

    @classmethod
    def from_serial(cls, norm: nn.LayerNorm, axis: AxisGroup) -> SequenceParallelLayerNorm:
        """The same LayerNorm (copied weights), now declaring partial gradients over tp."""
        ref = norm.weight
        layer = cls(norm.normalized_shape, axis, norm.eps, norm.elementwise_affine, norm.bias is not None,
                    device=None if ref is None else ref.device, dtype=None if ref is None else ref.dtype)
        layer.load_state_dict(norm.state_dict())
        return layer

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]


class ScatterSequence(nn.Module):
    """Entry of the sequence-parallel region: (B, N, D) replicated -> (B, N_local, D) shards.

    Fwd: keep own chunk along `seq_dim` (records N in `shards`); bwd: all-gather over `axis`.
    """

    def __init__(self, axis: AxisGroup, seq_dim: int, shards: SequenceShards):
        super().__init__()
        self.axis, self.seq_dim, self.shards = axis, seq_dim, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shards.enter(x.shape[self.seq_dim])
        return scatter_to_region(x, self.axis, self.seq_dim)


class GatherSequence(nn.Module):
    """Exit of the sequence-parallel region: (B, N_local, D) shards -> (B, N, D) replicated.

    Fwd: all-gather along `seq_dim` over `axis`; bwd: keep own chunk of the gradient.
    """

    def __init__(self, axis: AxisGroup, seq_dim: int, shards: SequenceShards):
        super().__init__()
        self.axis, self.seq_dim, self.shards = axis, seq_dim, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_region(x, self.axis, self.seq_dim, self.shards.sizes)
