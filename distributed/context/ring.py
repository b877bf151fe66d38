"""Ring attention for context parallelism (cp): exact attention over a sequence split across cp ranks.

Rank r of the cp axis holds its shard of queries, keys and values, q, k, v of shape (B, h, n_r, d)
with n_r = sizes[r] (uneven shards allowed). Keys and values travel around the ring (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"); no rank ever holds more than its own K/V block and the
one in flight, never the full K/V.

Forward, steps s = 0 .. cp-1: at step s rank r holds the K/V block of rank j = (r - s) mod cp. It starts
passing that block to rank r+1 (receiving block j-1 from rank r-1) before computing on it, so the
transfer runs under the compute (`ring_shift`, double buffered), then attends its queries to the block
(`block_attention`, which returns the block output and its log-sum-exp, LSE) and folds the result into
its running output with the online-softmax `merge`. Saved for backward: q, k, v, the output and the
LSE (B, h, n_r), nothing gathered.

Backward (flash-attention style, Dao 2023, alg. 2): each block's probabilities are recomputed from the
saved LSE, P = exp(S * scale - lse) with S = Q K^T, and with D = rowsum(dO * O):
    dV_j += P^T dO,   dP = dO V_j^T,   dS = P * (dP - D),   dQ += scale * dS K_j,   dK_j += scale * dS^T Q.
dQ accumulates locally. K/V travel as in forward; the partial dK_j/dV_j travel one step behind them:
at step s rank r adds its contribution to the dK_j/dV_j that rank r-1 sent at step s-1, then sends the
sum to rank r+1 (that transfer runs under the next step's compute). After cp steps every block's
gradient, summed over every rank's queries, is back at its home rank.

Masks: positions None is non-causal (every query sees every key). Otherwise positions[s] are the global
sequence positions of rank s's tokens (identical list on every rank; any layout, e.g. the load-balanced
one where rank r holds chunks r and 2cp-1-r of 2cp) and query i sees key j iff pos_q[i] >= pos_k[j].
A block with no visible pair is skipped (no compute); a fully visible one runs without a mask.

The balanced causal layout with equal chunks of c tokens (`chunk`; rank r holds chunks r and 2cp-1-r,
what `distributed/context/layout.py` gives the language model) has every block partly visible, so the
generic rule would compute all (2c)^2 pairs of each with a mask: 4c^2 x cp per rank where causality needs
about 2c^2 x cp. It is computed by chunk pair instead (Megatron-core and TransformerEngine do the same):
the own block as its first query chunk against its first key chunk (causal) and its second query chunk
against both (the first fully, the second causally): 3c^2; a block from a lower rank: every local query
against its first chunk only, 2c^2, no mask; from a higher rank: the second local query chunk against all
of it, 2c^2, no mask. Per rank (2cp + 1) x c^2 pairs, 1/cp of the full causal attention's (2cp c)^2 / 2
plus the diagonal chunks' share, the same on every rank; the bytes do not change.

Packed documents (`data.attention=document`, networks/documents.py): a query also sees only keys of its own
document, boundaries anywhere in a shard. Each hop's block is then planned from the batch's documents
(`_document_parts`): the balanced layout by chunk pair, each pair skipped when no query of any row sees a key of
its document there, run without a mask when every pair is visible, else with the (B, 1, rows, keys) mask; the plan
is made once per batch (one host read) and shared by every layer and the backward. `ring_work` counts the pairs
a rank scores; docs/measurements.md has them for WikiText-like documents before and after this skipping.

Precision: fp16/bf16 inputs are upcast per block and every sum (output, LSE, dQ, dK, dV) is float32,
under torch.autocast too (the forward turns it off: the blocks compute as written, as the backward does);
float32/float64 inputs compute natively. The output and gradients come back in the input dtype. Each
block runs `distributed/context/blocks.py`'s `attend` (its math path above on CPU; on CUDA the flash or
memory-efficient SDPA kernel, which keep the block in the input dtype with float32 accumulation, where the
dtype, head dim and mask allow).

Bytes rank r sends over the cp axis (counted by `ring_shift`), with KV(j) = bytes(K_j) + bytes(V_j) in
the input dtype and G(j) the same two blocks in the accumulation dtype (= KV(j) for float32/float64,
2 x KV(j) for fp16/bf16), j(s) = (r - s) mod cp:
    forward  = sum_{s=0}^{cp-2} KV(j(s))                      even shards: (cp-1) x 2 x block bytes
    backward = sum_{s=0}^{cp-2} KV(j(s)) + sum_{s=0}^{cp-1} G(j(s))
                                  even shards, fp32/fp64: (cp-1) x 2 + cp x 2 = (4cp-2) x block bytes
where block bytes = B * h * n * d * element size of one K (or V) block. A size-1 axis sends nothing
and computes the same blocks serially (cp=1 equals scaled_dot_product_attention). Not supported:
attention dropout, a custom scale (1/sqrt(d) as SDPA's default).

Grouped K/V (grouped-query attention: k and v with h/r heads, query head i reading kv head i // r): the
r query heads of a group are folded into one query sequence of r x n_r rows, (B, h/r, r x n_r, d),
and each block's mask repeated r times down its rows; the blocks, the LSE and the gradient sums then
run unchanged against the h/r-head K/V, which is what travels (r times fewer bytes than expanded K/V),
and dK/dV come out summed over the group's queries.
"""

from __future__ import annotations

import functools

# plant: ring_scores_under_autocast (next line)
import torch

from distributed.collectives import ring_shift
from distributed.context.blocks import attend, attend_backward, block_attention, compute_dtype  # noqa: F401
from networks.documents import Documents
from utils.comm import AxisGroup

KV_TAG, GRAD_TAG = 0, 2  # ring_shift tags: K/V and dK/dV are in flight at once (two tensors each)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from each one's (out, lse): exact, NaN-free at -inf."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def _block_mask(positions: list[torch.Tensor] | None, bounds: list[tuple[int, int] | None], q_rank: int,
                k_rank: int, group: int = 1) -> tuple[bool, torch.Tensor | None]:
    """(whether any query of `q_rank` sees any key of `k_rank`, the mask or None when all pairs do); the
    mask's rows repeated `group` times (the folded query heads of a key/value group)."""
    if bounds[q_rank] is None or bounds[k_rank] is None:  # an empty shard
        return False, None
    (q_min, q_max), (k_min, k_max) = bounds[q_rank], bounds[k_rank]
    if q_max < k_min:
        return False, None
    if q_min >= k_max:
        return True, None
    return True, (positions[q_rank][:, None] >= positions[k_rank][None, :]).repeat(group, 1)


def _shapes(k: torch.Tensor, v: torch.Tensor, n: int) -> list[tuple[int, ...]]:
    """Shapes of a K and a V block of n tokens."""
    return [(*k.shape[:-2], n, k.shape[-1]), (*v.shape[:-2], n, v.shape[-1])]


Part = tuple  # (query chunk: None for every row, 0 or 1; key chunk: None, 0 or 1; mask or None; whether the mask
#               is the square causal one)


def _hop_parts(rank: int, source: int, chunk: int | None, positions, bounds, group: int, device) -> list[Part]:
    """What this rank computes against the K/V block of rank `source`: the pairs of (query rows, keys), their
    masks and whether a mask is the square causal one (a kernel's `is_causal`). The generic layout: the whole
    block with its position mask, or nothing when no pair is visible. The balanced causal layout with equal
    chunks (`chunk` tokens; rank r holds chunks r and 2cp-1-r), split by chunk pair as Megatron and
    TransformerEngine do: the own block causally (its first query chunk against its first key chunk, its
    second against the first fully and the second causally); a lower source rank: every local query against
    the source's first chunk; a higher one: the second local query chunk against all of it; the last two
    without a mask. Every rank computes the same number of pairs."""
    if chunk is None:
        visible, mask = _block_mask(positions, bounds, rank, source, group)
        return [(None, None, mask, False)] if visible else []
    if source == rank:
        tril = _causal_mask(chunk, group, str(device))
        return [(0, 0, tril, True), (1, 0, None, False), (1, 1, tril, True)]
    return [(None, 0, None, False)] if source < rank else [(1, None, None, False)]


def _document_parts(rank: int, source: int, chunk: int | None, positions: list[torch.Tensor], documents: Documents,
                    group: int, tag: str) -> list[Part]:
    """`_hop_parts` with packed documents (`documents.masked`): the block's mask is causal and inside each document
    (per batch row, (B, 1, rows, keys)), so a block or chunk pair where no query sees a key of its own document
    is skipped, one where every pair is visible runs without a mask. The balanced layout is cut by chunk pair
    (each pair skipped or kept on its own), any other layout taken as whole blocks. Made once per batch and
    block (a host read of the mask), for every layer and the backward (`documents.cache`)."""
    key = (tag, rank, source, chunk, group)
    if key not in documents.cache:
        full = documents.mask(positions[rank], positions[source])[:, 0]  # (B, nq, nk)
        spans = [(None, None, full)] if chunk is None else [
            (r, c, full[:, r * chunk:(r + 1) * chunk, c * chunk:(c + 1) * chunk]) for r in (0, 1) for c in (0, 1)]
        # plant: document_block_unmasked (next line)
        documents.cache[key] = [(rows, keys, None if bool(m.all()) else m.repeat(1, group, 1)[:, None], False)
                                for rows, keys, m in spans if bool(m.any())]
    return documents.cache[key]


def ring_work(rank: int, sizes: list[int], positions: list[torch.Tensor] | None, chunk: int | None = None,
              documents: Documents | None = None) -> int:
    """Query-key pairs rank `rank` scores over the ring's cp hops, per batch row and head: the score-block work
    the plan computes (`_hop_parts`, or `_document_parts` with documents) after skipping."""
    bounds, total = position_bounds(positions, sizes), 0
    for source in range(len(sizes)):
        parts = _document_parts(rank, source, chunk, positions, documents, 1, "work") if documents is not None \
            else _hop_parts(rank, source, chunk, positions, bounds, 1, "cpu")
        total += sum((sizes[rank] if rows is None else chunk) * (sizes[source] if keys is None else chunk)
                     for rows, keys, _, _ in parts)
    return total


@functools.lru_cache(maxsize=16)
def _causal_mask(chunk: int, group: int, device: str) -> torch.Tensor:
    """The own block's diagonal chunks' causal mask (made once per shape), rows repeated per folded head."""
    return torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril().repeat(group, 1)


def _rows(x: torch.Tensor, group: int, part: int) -> torch.Tensor:
    """A view of the rows of chunk `part` of every folded query head: (B, G, group, chunk, ...)."""
    return x.unflatten(2, (group, 2, -1)).select(3, part)


def _take(x: torch.Tensor, group: int, part: int | None) -> torch.Tensor:
    """The query rows of chunk `part` (all rows for None), (B, G, rows, ...)."""
    return x if part is None else _rows(x, group, part).flatten(2, 3)


def _keys(x: torch.Tensor, part: int | None, chunk: int | None) -> torch.Tensor:
    """The keys of chunk `part` of a K/V block (all keys for None)."""
    return x if part is None else x.narrow(2, part * chunk, chunk)


class _RingAttention(torch.autograd.Function):
    """Ring attention over `axis`: K/V blocks around the ring forward, K/V and dK/dV backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: AxisGroup, sizes: list[int],
                positions: list[torch.Tensor] | None, bounds: list[tuple[int, int] | None], group: int,
                chunk: int | None, documents: Documents | None, tag: str) -> torch.Tensor:
        cp, rank, scale = axis.size, axis.rank, q.shape[-1] ** -0.5
        positions = None if positions is None else [p.to(q.device) for p in positions]
        dtype = compute_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)
        kv = [k, v]
        # The trainer calls attention inside torch.autocast, which would turn the upcast matmuls back into
        # bf16 ones (scores, row max, sums and LSE in bf16, and a backward recomputing P in float32 from an
        # LSE of bf16 scores): the blocks compute exactly as written, as the backward does (no autocast there)
        with torch.autocast(q.device.type, enabled=False):  # plant: ring_scores_under_autocast
            for step in range(cp):
                if step < cp - 1:  # start the next block's transfer, then compute on this one
                    arriving = ring_shift(kv, axis, _shapes(k, v, sizes[(rank - step - 1) % cp]), KV_TAG)
                for rows, keys, mask, causal in _parts(rank, (rank - step) % cp, chunk, positions, bounds, group,
                                                       q.device, documents, tag):
                    part = attend(_take(q, group, rows), _keys(kv[0], keys, chunk), _keys(kv[1], keys, chunk),
                                  mask, causal, scale, group)
                    if rows is None:
                        out, lse = merge(out, lse, *part)
                    else:  # merge into the chunk's rows in place
                        o_rows, l_rows = _rows(out, group, rows), _rows(lse, group, rows)
                        merged = merge(o_rows.flatten(2, 3), l_rows.flatten(2, 3), *part)
                        o_rows.copy_(merged[0].unflatten(2, (group, -1)))
                        l_rows.copy_(merged[1].unflatten(2, (group, -1)))
                if step < cp - 1:
                    kv = arriving()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.sizes, ctx.positions, ctx.bounds, ctx.scale = axis, sizes, positions, bounds, scale
        ctx.group, ctx.chunk, ctx.documents, ctx.tag = group, chunk, documents, tag
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, group, chunk = ctx.axis.size, ctx.axis.rank, ctx.group, ctx.chunk
        dtype = lse.dtype
        delta = (dout.to(dtype) * out.to(dtype)).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q, dtype=dtype)
        kv, grads_arriving = [k, v], None
        for step in range(cp):
            source, upstream = (rank - step) % cp, (rank - step - 1) % cp
            if step < cp - 1:
                kv_arriving = ring_shift(kv, ctx.axis, _shapes(k, v, ctx.sizes[upstream]), KV_TAG)
            dk, dv = (t.new_zeros(t.shape, dtype=dtype) for t in kv)
            for rows, keys, mask, causal in _parts(rank, source, chunk, ctx.positions, ctx.bounds, group, q.device,
                                                   ctx.documents, ctx.tag):
                dq_part, dk_part, dv_part = attend_backward(
                    _take(q, group, rows), _keys(kv[0], keys, chunk), _keys(kv[1], keys, chunk),
                    *(_take(t, group, rows) for t in (dout, out, delta, lse)), mask, causal, ctx.scale, group)
                if rows is None:
                    dq += dq_part
                else:
                    _rows(dq, group, rows).add_(dq_part.unflatten(2, (group, -1)))
                _keys(dk, keys, chunk).add_(dk_part)
                _keys(dv, keys, chunk).add_(dv_part)
            if grads_arriving is not None:  # what the ranks before this one added to this block
                dk_up, dv_up = grads_arriving()
                dk, dv = dk + dk_up, dv + dv_up
            grads_arriving = ring_shift([dk, dv], ctx.axis, _shapes(dk, dv, ctx.sizes[upstream]), GRAD_TAG)
            if step < cp - 1:
                kv = kv_arriving()
        dk, dv = grads_arriving()  # this rank's own block, summed over every rank's queries
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 8


def _parts(rank, source, chunk, positions, bounds, group, device, documents, tag) -> list[Part]:
    """The block plan against rank `source`'s K/V: by positions alone, or with the documents' mask."""
    if documents is None:
        return _hop_parts(rank, source, chunk, positions, bounds, group, device)
    return _document_parts(rank, source, chunk, positions, documents, group, tag)


def position_bounds(positions: list[torch.Tensor] | None, sizes: list[int]) -> list[tuple[int, int] | None]:
    """(min, max) position of each rank's tokens as ints, None for an empty shard.

    Non-causal attention puts every token at position 0: every block is then fully visible.
    """
    if positions is None:
        return [(0, 0) if n else None for n in sizes]
    return [(int(p.min()), int(p.max())) if p.numel() else None for p in positions]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: AxisGroup, sizes: list[int],
                   positions: list[torch.Tensor] | None,
                   bounds: list[tuple[int, int] | None] | None = None, chunk: int | None = None,
                   documents: Documents | None = None, tag: str = "ring") -> torch.Tensor:
    """Exact softmax attention (scale 1/sqrt(d)) of this rank's queries to the keys of every cp rank.

    q, k, v: this rank's shards (B, h, n_r, d), n_r = sizes[axis.rank] (k and v may have h/r heads:
    grouped-query attention, query head i reading kv head i // r). `positions`: None for
    non-causal attention, else the global positions of each rank's tokens (causal: query i sees key j
    iff pos_q[i] >= pos_k[j]). `bounds`: `position_bounds(positions, sizes)` when the caller keeps them
    (computed here otherwise: on a GPU that reads the positions back, a sync). `chunk`: the positions are
    the balanced causal layout with equal chunks of `chunk` tokens (rank r: chunks r and 2cp-1-r), computed
    by chunk pair with no wasted pair (module doc). `documents` (packed rows, `documents.masked`): attention also
    inside each document, `positions` then being the sequence positions of each rank's tokens in the batch's rows
    (`_document_parts`; `tag` names the layout in the documents' plan cache). Returns (B, h, n_r, d) in q's dtype;
    differentiable in q, k and v.
    """
    assert len(sizes) == axis.size and q.shape[-2] == k.shape[-2] == v.shape[-2] == sizes[axis.rank], \
        f"sizes {sizes} do not match the local length {q.shape[-2]} on rank {axis.rank} of {axis.name}"
    assert positions is None or [p.numel() for p in positions] == list(sizes), "positions do not match sizes"
    bounds = bounds if bounds is not None else position_bounds(positions, sizes)
    batch, heads, n, d = q.shape
    group = heads // k.shape[1]
    assert k.shape[1] * group == heads, f"{heads} query heads cannot read {k.shape[1]} key/value heads"
    q = q.unflatten(1, (k.shape[1], group)).flatten(2, 3)  # (B, h/r, r x n_r, d): a group's queries in a row
    assert chunk is None or (positions is not None and all(n == 2 * chunk for n in sizes)), "chunks must be equal"
    assert documents is None or positions is not None, "documents need the positions of each rank's tokens"
    out = _RingAttention.apply(q, k, v, axis, list(sizes), positions, bounds, group, chunk, documents, tag)
    return out.unflatten(2, (group, n)).flatten(1, 2)  # (B, h, n_r, d)
