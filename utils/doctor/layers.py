"""Every parallel layer of distributed/tensor/ against its serial twin, on the device, in fp32 and bf16.

Each layer is built from a serial torch layer with the same full weights (`from_serial`), runs forward and
backward on the same input and cotangent (this rank's shard of them), and is compared with the serial layer in
the output, the input gradient and every weight gradient (a sharded weight's against the matching shard of the
serial one; replicated weights after `sync_partial_grads`): with and without sequence parallelism, with an uneven
sequence (7 tokens) and uneven feature splits (10 features, an 18-row vocabulary of which 13 are real), as
tests/test_layers.py does in float64 on CPU.

Tolerance from the dtype: both sides round the same sums in another order (partial sums over ranks, another
matmul blocking), so they differ by a few roundings of each value: relative error ||parallel - serial|| /
||serial|| <= 8 eps (fp32 9.5e-7, bf16 6.2e-2). A wrong shard or a missing sum is off by 0.5 or more.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed.data_parallel import sync_partial_grads
from distributed.tensor.layers import (
    ColumnParallelLinear,
    GroupedQKVParallelLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    SequenceShards,
    shard,
)
from distributed.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from networks.transformer import CausalLMLoss
from utils.comm import AxisGroup
from utils.doctor.adjoints import DTYPES, randn
from utils.doctor.report import Check

B, N, D_IN, D_OUT, VOCAB, VALID = 2, 7, 6, 10, 18, 13


def tolerance(dtype: torch.dtype) -> float:
    return 8 * torch.finfo(dtype).eps


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _filled(module: nn.Module, seed: int) -> nn.Module:
    """`module` with every parameter drawn from `seed`: the same full weights on every rank."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(randn(p.shape, seed + i, p.dtype, p.device))
    return module


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}


def _run(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor, sync: bool = False):
    """(output, input gradient, {parameter: gradient}) of one forward and backward."""
    x = x.clone().requires_grad_(x.is_floating_point())
    y = module(x)
    y.backward(cotangent)
    if sync:
        sync_partial_grads(module)
    return y.detach(), x.grad, _grads(module)


def column(axis: AxisGroup, dtype, device, sp: bool, gather: bool) -> list[tuple]:
    serial = _filled(nn.Linear(D_IN, D_OUT, device=device, dtype=dtype), 1)
    x, g = randn((B, N, D_IN), 2, dtype, device), randn((B, N, D_OUT), 3, dtype, device)
    y_ref, dx_ref, dw_ref = _run(serial, x, g)
    shards = SequenceShards(axis)
    shards.enter(N)
    layer = ColumnParallelLinear.from_serial(serial, axis, sequence_parallel=sp, gather_output=gather, shards=shards)
    y, dx, dw = _run(layer, shard(x, axis, 1) if sp else x, g if gather else shard(g, axis, -1))
    return [("output", y, y_ref if gather else shard(y_ref, axis, -1)),
            ("input grad", dx, shard(dx_ref, axis, 1) if sp else dx_ref),
            ("weight grad", dw["weight"], shard(dw_ref["weight"], axis, 0)),
            ("bias grad", dw["bias"], shard(dw_ref["bias"], axis, 0))]


def row(axis: AxisGroup, dtype, device, sp: bool, input_is_parallel: bool) -> list[tuple]:
    serial = _filled(nn.Linear(D_OUT, D_IN, device=device, dtype=dtype), 4)  # 10 in features: uneven over 4 ranks
    x, g = randn((B, N, D_OUT), 5, dtype, device), randn((B, N, D_IN), 6, dtype, device)
    y_ref, dx_ref, dw_ref = _run(serial, x, g)
    layer = RowParallelLinear.from_serial(serial, axis, sequence_parallel=sp, input_is_parallel=input_is_parallel)
    y, dx, dw = _run(layer, shard(x, axis, -1) if input_is_parallel else x, shard(g, axis, 1) if sp else g, sync=True)
    return [("output", y, shard(y_ref, axis, 1) if sp else y_ref),
            ("input grad", dx, shard(dx_ref, axis, -1) if input_is_parallel else dx_ref),
            ("weight grad", dw["weight"], shard(dw_ref["weight"], axis, 1)), ("bias grad", dw["bias"], dw_ref["bias"])]


def grouped_qkv(axis: AxisGroup, dtype, device, sp: bool) -> list[tuple]:
    """One key/value group over every rank of `axis`: a rank's cotangent on the group's k, v rows is its 1/n."""
    heads, head_dim = 2 * axis.size, 2
    serial = _filled(nn.Linear(D_IN, (heads + 2) * head_dim, device=device, dtype=dtype), 16)
    x, g = randn((B, N, D_IN), 17, dtype, device), randn((B, N, (heads + 2) * head_dim), 18, dtype, device)
    y_ref, dx_ref, dw_ref = _run(serial, x, g)
    shards = SequenceShards(axis)
    shards.enter(N)
    layer = GroupedQKVParallelLinear(serial, axis, 1, heads, head_dim, sequence_parallel=sp, shards=shards)
    kv = (torch.arange(len(layer.rows)) >= layer.q_local * head_dim).to(device)
    cotangent = torch.where(kv, g[..., layer.rows] / axis.size, g[..., layer.rows])
    y, dx, dw = _run(layer, shard(x, axis, 1) if sp else x, cotangent, sync=True)
    return [("output", y, y_ref[..., layer.rows]), ("input grad", dx, shard(dx_ref, axis, 1) if sp else dx_ref),
            ("weight grad", dw["weight"], dw_ref["weight"]), ("bias grad", dw["bias"], dw_ref["bias"])]


def norm(axis: AxisGroup, dtype, device, kind: type) -> list[tuple]:
    serial = _filled(kind(D_IN, device=device, dtype=dtype), 7)  # non-trivial affine weights
    x, g = randn((B, N, D_IN), 9, dtype, device), randn((B, N, D_IN), 10, dtype, device)
    y_ref, dx_ref, dw_ref = _run(serial, x, g)
    layer = SequenceParallelNorm.from_serial(serial, axis)
    y, dx, dw = _run(layer, shard(x, axis, 1), shard(g, axis, 1), sync=True)
    return [("output", y, shard(y_ref, axis, 1)), ("input grad", dx, shard(dx_ref, axis, 1)),
            *((f"{name} grad", dw[name], dw_ref[name]) for name in dw_ref)]


def embedding(axis: AxisGroup, dtype, device, sp: bool) -> list[tuple]:
    serial = _filled(nn.Embedding(VOCAB, D_IN, device=device, dtype=dtype), 11)
    ids = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(12)).to(device)
    g = randn((B, N, D_IN), 13, dtype, device)
    y_ref, _, dw_ref = _run(serial, ids, g)
    layer = VocabParallelEmbedding.from_serial(serial, axis, sequence_parallel=sp)
    y, _, dw = _run(layer, ids, shard(g, axis, 1) if sp else g)
    return [("output", y, shard(y_ref, axis, 1) if sp else y_ref),
            ("weight grad", dw["weight"], shard(dw_ref["weight"], axis, 0))]


def cross_entropy(axis: AxisGroup, dtype, device) -> list[tuple]:
    logits = randn((B, N, VOCAB), 14, dtype, device)
    targets = torch.randint(0, VALID, (B, N), generator=torch.Generator().manual_seed(15)).to(device)
    targets[0, 2] = -100  # an ignored token
    full = logits.clone().requires_grad_(True)
    loss_ref = CausalLMLoss(VALID)(full, targets)
    loss_ref.backward()
    local = shard(logits, axis, -1).requires_grad_(True)
    loss = VocabParallelCrossEntropy.from_serial(CausalLMLoss(VALID), axis, VOCAB)(local, targets)
    loss.backward()
    return [("loss", loss.detach(), loss_ref.detach()), ("logits grad", local.grad, shard(full.grad, axis, -1))]


def layer_cases(axis: AxisGroup, dtype, device):
    """(name, compared tensors) of every layer and setting."""
    yield "RowParallelLinear (SP off, input split here)", row(axis, dtype, device, False, False)
    for sp in (False, True):
        on = "on" if sp else "off"
        for gather in (False, True):
            yield f"ColumnParallelLinear (SP {on}, gather_output {gather})", column(axis, dtype, device, sp, gather)
        yield f"RowParallelLinear (SP {on})", row(axis, dtype, device, sp, True)
        yield f"GroupedQKVParallelLinear (SP {on})", grouped_qkv(axis, dtype, device, sp)
        yield f"VocabParallelEmbedding (SP {on})", embedding(axis, dtype, device, sp)
    yield "SequenceParallelLayerNorm", norm(axis, dtype, device, nn.LayerNorm)
    yield "SequenceParallelRMSNorm", norm(axis, dtype, device, nn.RMSNorm)
    yield "VocabParallelCrossEntropy", cross_entropy(axis, dtype, device)


def layer_checks(axis: AxisGroup, device: torch.device) -> list[Check]:
    """A line per layer, setting and dtype on `axis`: the worst relative error of its compared tensors."""
    checks = []
    for dtype in DTYPES:
        tol, kind = tolerance(dtype), str(dtype).removeprefix("torch.")
        for name, compared in layer_cases(axis, dtype, device):
            errors = {what: rel_error(got, want) for what, got, want in compared}
            what, worst = max(errors.items(), key=lambda item: item[1])
            checks.append(Check("layers", f"{name} on {axis.name} ({axis.size} ranks), {kind}",
                                "pass" if worst <= tol else "fail",
                                f"worst relative error {worst:.2g} ({what}), tolerance {tol:.2g}",
                                {"errors": errors, "tolerance": tol}))
    return checks
