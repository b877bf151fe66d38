"""SPMD types for the parallel mappings: the second oracle (tests/typecheck.py runs it; docs/testing.md).

Each autograd Function of `distributed/mappings.py` (and the two other Functions that communicate inside
the model: the vocabulary-parallel cross-entropy and ring attention) gets a type signature on the axis it
is given, in the local SPMD types of meta-pytorch's `spmd-types` (PyPI `spmd-types`, a test-only
dependency): per mesh axis a tensor is R (replicated; its gradient is a pending sum, P), I (invariant:
replicated, and so is its gradient), V (varying: per-rank values, S(d) when sharded along d; gradient V)
or P (a pending sum; gradient R). The forward signatures (`SIGNATURES`):

    copy_to_region         I    -> R     (Megatron `f`: the backward all-reduces the P gradient to I)
    reduce_from_region     P|V  -> I     (Megatron `g`; V: a row-parallel matmul's local, unsummed output)
    scatter_to_region      I    -> S(d)
    gather_from_region     S(d) -> I
    all_gather_region      S(d) -> R     (sequence parallelism's `g`, cp's K/V gather)
    reduce_scatter_region  P|V  -> S(d)
    all_gather_linear      x S(d) -> R, then x @ W^T + b with W, b V -> V
    sequence_to_heads      S(2) -> S(1), heads_to_sequence S(1) -> S(2)   (all-to-all)
    vocab cross-entropy    logits V -> per-token loss I (its all-reduces are inside)
    ring attention         q, k, v V -> V (its point-to-point shifts are inside)
    ContextShards.shard    R -> S(d) on cp (the cp split of the full sequence: backward scatters, V -> P)

`checking(grid)` turns the types on: inside it, `typed_forward()` regions (the harness wraps a training step's
forward and loss in one) run under spmd-types' type-checking mode, which infers the type of every torch op from
its operands and raises `SpmdTypeError` where they do not combine (I with V or P, P through a non-linear op,
...); each mapping checks its input against its signature and stamps its output. Backward is not a forward
type inference: spmd-types trusts a Function's backward. So each mapping's backward is checked here: its
incoming gradient is typed the backward type of its output, the body runs under the checking mode with the
collectives it calls (all_reduce, all_gather, reduce_scatter, own_chunk, all_to_all of the counted door)
typed, and every gradient it returns must have the backward type of its input (R and I count as one here:
both are the same value on every rank). Last, the gradient sync: a parameter typed R on tp (a replicated
weight used on sequence shards: `partial_grad_params`) receives a P gradient, which `sum_grads` must turn to
R before the optimizer; `unsummed()` lists those that were not.

Parameters are typed on tp from the layers' declarations: sharded (`shard_dims`) V, partial
(`partial_grad_params`) R, every other I; on cp every parameter is R (each rank's tokens give a partial
gradient, summed by the data-parallel reduction over dp x cp, which is not typed here). Inputs are I on tp
and R on cp.

Off by default: nothing here imports spmd-types or patches anything until `checking` is entered, and
`distributed/mappings.py` is untouched (the Functions are typed by class attributes set inside `checking`
and removed at its exit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

MAPPINGS = "distributed.mappings"
# Function class in distributed.mappings -> (forward input type, output type) on its axis. "S" is S(dim) of the
# call; "P|V": a pending sum, or a varying local result read as one (spmd-types' all_reduce(src=V)).
SIGNATURES = {
    "_CopyToRegion": ("I", "R"),
    "_ReduceFromRegion": ("P|V", "I"),
    "_ScatterToRegion": ("I", "S"),
    "_GatherFromRegion": ("S", "I"),
    "_AllGatherRegion": ("S", "R"),
    "_AllGatherLinear": ("S", "V"),
    "_ReduceScatterRegion": ("P|V", "S"),
    "_SequenceToHeads": ("S2", "S1"),
    "_HeadsToSequence": ("S1", "S2"),
}
# The collectives the mappings' backwards call (names in distributed.mappings), typed while a backward is checked.
DOORS = ("all_reduce", "all_gather", "reduce_scatter", "own_chunk", "all_to_all")


@dataclass
class Session:
    grid: object
    axes: dict  # axis name ('tp', 'cp') -> AxisGroup of size > 1
    param_types: dict  # id(param) -> {axis name: 'R' | 'I' | 'V'}
    partial: dict  # id(param) -> (name, set of axis names its gradient is partial over)
    summed: dict  # id(param) -> set of axis names sum_grads reduced its gradient over
    backward_checks: int = 0
    in_backward: int = 0  # depth of checked backward bodies (the doors are typed there only)


_session: Session | None = None


def _spmd():
    import spmd_types
    import spmd_types.checker  # noqa: F401 (the checking mode)

    return spmd_types


def _t(name: str):
    s = _spmd()
    return {"R": s.R, "I": s.I, "V": s.V, "P": s.P}[name]


def _group(axis):
    """The process group whose mesh axis types `axis`: its own, or cp's for hierarchical cp's all-to-all group and
    ring across groups (sub-axes of cp: a tensor sharded over them is sharded over cp, V there)."""
    if _session is not None and axis.name.startswith("cp_") and "cp" in _session.axes:
        return _session.axes["cp"].group
    return axis.group


def _type_on(x: torch.Tensor, group):
    """x's local type on the process group's axis, or None."""
    s = _spmd()
    return s.get_local_type(x).get(s.MeshAxis.of(group)) if s.has_local_type(x) else None


def _same_value(a, b) -> bool:
    """Equal types, R and I counted as one (the same value on every rank; they differ in the gradient only)."""
    s = _spmd()
    same = {s.R, s.I}
    return a is b or (a in same and b in same)


def _error(msg: str):
    return _spmd().SpmdTypeError(msg)


# ----------------------------------------------------------------------------------------------------------------
# Forward rules: spmd_typecheck hooks (spmd-types runs them after the Function's real apply)


def _shard(spec: str, dim: int):
    s = _spmd()
    return s.S(int(spec[1:]) if len(spec) > 1 else dim)


def _src(x, group, spec: str, dim: int):
    s = _spmd()
    if spec == "P|V":
        return s.V if _type_on(x, group) is s.V else s.P
    return _shard(spec, dim) if spec.startswith("S") else _t(spec)


def _mapping_rule(name: str):
    src_spec, dst_spec = SIGNATURES[name]

    def transition(x, group, dim):
        s, rules = _spmd(), _spmd().rules
        src = _src(x, group, src_spec, dim)
        dst = _shard(dst_spec, dim) if dst_spec.startswith("S") else _t(dst_spec)
        if src_spec == "P|V":
            if dst_spec.startswith("S"):
                return rules.reduce_scatter(x, group, src=src, dst=dst)
            return rules.all_reduce(x, group, src=src, dst=dst)
        if src_spec.startswith("S") and dst_spec.startswith("S"):
            return rules.all_to_all(x, group, src=src, dst=dst)
        if src_spec.startswith("S"):
            return rules.all_gather(x, group, src=src, dst=dst)
        return rules.convert(x, group, src=src, dst=dst if dst is not s.R else s.R)

    if name == "_AllGatherLinear":
        def rule(outputs, *, x, weight, bias, axis, dim):
            s, rules = _spmd(), _spmd().rules
            full = rules.all_gather(x, axis.group, src=s.S(dim), dst=s.R)
            y = rules.einsum("...k,nk->...n", full, weight)
            if bias is not None:
                y = rules.einsum("...n,n->...n", y, bias)  # typed as the add it is: V with V
            rules.output(outputs, y)
    elif name in ("_SequenceToHeads", "_HeadsToSequence"):
        def rule(outputs, *, x, axis):
            _spmd().rules.output(outputs, transition(x, _group(axis), 0))
    elif name in ("_CopyToRegion", "_ReduceFromRegion"):
        def rule(outputs, *, x, axis):
            _spmd().rules.output(outputs, transition(x, axis.group, 0))
    else:
        def rule(outputs, *, x, axis, dim):
            _spmd().rules.output(outputs, transition(x, axis.group, dim))
    return rule


def _vocab_cross_entropy_rule(outputs, *, logits, targets, axis):
    """Vocab-sharded logits (V) -> per-token loss, all-reduced inside: I on the axis."""
    s = _spmd()
    s.rules.ignore(targets)
    if _type_on(logits, axis.group) not in (None, s.V):
        raise _error(f"vocab-parallel cross-entropy: logits must be V on {axis.name} (vocabulary shards), "
                     f"are {_type_on(logits, axis.group)!r}")
    typed = s.rules.all_reduce(s.rules.reinterpret(logits, axis.group, src=s.V, dst=s.V), axis.group,
                               src=s.V, dst=s.I)
    s.assert_type(outputs, dict(s.get_local_type(typed)))


def _ring_rule(outputs, *, q, k, v, axis, positions):
    """Ring attention: q, k, v sequence shards (V) on the ring's axis -> V; other axes as q's."""
    s = _spmd()
    s.rules.ignore(*[t for t in positions or () if isinstance(t, torch.Tensor)])  # this rank's token positions
    group = _group(axis)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _type_on(t, group) not in (None, s.V):
            raise _error(f"ring attention: {name} must be V (sequence shards) on {axis.name}, "
                         f"is {_type_on(t, group)!r}")
    s.rules.ignore(k, v)
    typed = s.rules.convert(q, group, src=s.V, dst=s.V)
    for name, t in (("k", k), ("v", v)):
        for ax, ty in s.get_local_type(t).items():
            if ax in s.get_local_type(typed) and not _same_value(s.get_local_type(typed)[ax], ty):
                raise _error(f"ring attention: {name} is {ty!r} on {ax} where q is {s.get_local_type(typed)[ax]!r}")
    s.rules.output(outputs, typed)


def _copy_types(outputs, inputs) -> None:
    """Output i has input i's type (identity Functions of FSDP and DDP that wrap a module's inputs or outputs)."""
    from spmd_types.runtime import _set_local_type

    s = _spmd()
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    ins = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    s.rules.ignore(*[t for t in ins if isinstance(t, torch.Tensor)])
    for o, i in zip(outs, ins):
        if isinstance(o, torch.Tensor):
            _set_local_type(o, dict(s.get_local_type(i)) if isinstance(i, torch.Tensor) and s.has_local_type(i) else {})


def _pass_inputs(outputs, *, inputs):
    _copy_types(outputs, inputs)


def _pass_output(outputs, *, output):
    _copy_types(outputs, output)


def _identity_functions() -> list[tuple[type, object]]:
    """FSDP's and DDP's identity Functions around module inputs and outputs, with their pass-through rules."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state
    from torch.nn.parallel import distributed as ddp

    found = [(getattr(_fsdp_param_group, "RegisterPostBackwardFunction", None), _pass_inputs),
             (getattr(_fsdp_state, "RegisterPreBackwardFunction", None), _pass_output),
             (getattr(ddp, "_DDPSink", None), _pass_inputs)]
    return [(cls, rule) for cls, rule in found if cls is not None]


# ----------------------------------------------------------------------------------------------------------------
# Backward checks


def _grad_types(name: str, ctx):
    """(type of the incoming gradient, expected type of the input gradient) on the Function's axis."""
    src_spec, dst_spec = SIGNATURES[name]
    s = _spmd()
    kind = {"I": s.I, "R": s.R, "V": s.V, "P": s.P}
    out = s.V if dst_spec.startswith("S") else kind[dst_spec]
    inp = s.P if src_spec == "P|V" else s.V if src_spec.startswith("S") else kind[src_spec]
    return out.backward_type(), inp.backward_type()


def _typed_door(name: str, real):
    """A collective of the counted door, typed: checks its input's type on its axis and stamps its output."""
    @functools.wraps(real)
    def door(x, axis, *args, **kwargs):
        s = _spmd()
        with s.no_typecheck():
            out = real(x, axis, *args, **kwargs)
        if axis.size == 1 or _session is None or not _session.in_backward or not s.has_local_type(x):
            return out  # forward bodies: the Function's rule types the output
        g = _group(axis)
        have, others = _type_on(x, g), dict(s.get_local_type(x))
        if name == "all_reduce":
            if have not in (s.P, s.V):
                raise _error(f"all_reduce over {axis.name} sums a {have!r} tensor: only a pending sum (P, or V read as "
                             "one) may be summed; a replicated value would be counted {axis.size} times")
            new = s.R
        elif name == "reduce_scatter":
            if have not in (s.P, s.V):
                raise _error(f"reduce_scatter over {axis.name} of a {have!r} tensor: it needs a pending sum (P|V)")
            new = s.V
        elif name == "all_gather":
            if have is not s.V:
                raise _error(f"all_gather over {axis.name} of a {have!r} tensor: it needs shards (V)")
            new = s.R
        elif name == "own_chunk":
            if have not in (s.R, s.I):
                raise _error(f"own_chunk over {axis.name} keeps this rank's chunk of a {have!r} tensor: only a full "
                             "value (R|I) may be split without communication"
                             + ("; a pending sum (P) must be reduce-scattered" if have is s.P else ""))
            new = s.V
        else:  # all_to_all
            if have is not s.V:
                raise _error(f"all_to_all over {axis.name} of a {have!r} tensor: it needs shards (V)")
            new = s.V
        others[s.MeshAxis.of(g)] = new
        s.assert_type(out, others)
        return out
    door.__wrapped_door__ = real
    return door


def _checked_backward(name: str, real):
    @functools.wraps(real)
    def backward(ctx, *grads):
        axis = getattr(ctx, "_spmd_axis", None)
        if _session is None or axis is None or axis.size == 1:
            return real(ctx, *grads)
        s, group = _spmd(), _group(axis)
        incoming, expected = _grad_types(name, ctx)
        typed = []
        for g in grads:
            if isinstance(g, torch.Tensor):
                have = _type_on(g, group)
                if have is not None and not _same_value(have, incoming):
                    raise _error(f"{_public(name)} backward on {axis.name}: the incoming gradient is {have!r}, but the "
                                 f"forward output's type makes it {incoming!r}")
                if s.has_local_type(g):
                    g = g.view_as(g)  # a fresh alias (outside the checking mode: untyped) to type on this axis
                s.assert_type(g, {group: incoming})
            typed.append(g)
        _session.in_backward += 1
        with s.checker.typecheck(strict_mode="permissive"), _leaving(_session):
            result = real(ctx, *typed)
        _session.backward_checks += 1
        outs = result if isinstance(result, tuple) else (result,)
        for i, (g, want) in enumerate(zip(outs, _input_grad_types(name, expected))):
            if not isinstance(g, torch.Tensor) or want is None:
                continue
            have = _type_on(g, group)
            if have is None or not _same_value(have, want):
                raise _error(f"{_public(name)} backward on {axis.name}: the gradient of input {i} is "
                             f"{have if have is not None else 'untyped'} but must be {want!r} (the backward type of "
                             f"its forward type){_hint(name, have)}")
        return result
    backward.__checked__ = real
    return backward


@contextlib.contextmanager
def _leaving(session: Session):
    try:
        yield
    finally:
        session.in_backward -= 1


def _input_grad_types(name: str, expected):
    s = _spmd()
    if name == "_AllGatherLinear":
        return (expected, s.V, s.V)  # dX, dW and db (the weight and bias are column shards: V)
    return (expected,)


def _hint(name: str, have) -> str:
    s = _spmd()
    if have is s.P:
        return ": a pending sum left unreduced (a missing all-reduce or reduce-scatter)"
    return ""


def _public(name: str) -> str:
    return {"_CopyToRegion": "copy_to_region", "_ReduceFromRegion": "reduce_from_region",
            "_ScatterToRegion": "scatter_to_region", "_GatherFromRegion": "gather_from_region",
            "_AllGatherRegion": "all_gather_region", "_AllGatherLinear": "all_gather_linear",
            "_ReduceScatterRegion": "reduce_scatter_region", "_SequenceToHeads": "sequence_to_heads",
            "_HeadsToSequence": "heads_to_sequence"}.get(name, name)


def _remembering_forward(real, axis_pos: int):
    @functools.wraps(real)
    def forward(ctx, *args):
        ctx._spmd_axis = args[axis_pos]
        return real(ctx, *args)
    forward.__remembering__ = real
    return forward


# ----------------------------------------------------------------------------------------------------------------
# Parameters, the cp split, the gradient sync


def _param_types(model: nn.Module, axes: dict) -> tuple[dict, dict]:
    """(id(param) -> {axis name: type name}, id(param) -> (name, axis names its grad is partial over))."""
    types, partial = {}, {}
    tp = axes.get("tp")
    for mod_name, module in model.named_modules():
        shard_dims = getattr(module, "shard_dims", {}) if getattr(module, "axis", None) is tp else {}
        declared = {id(p) for p in module.partial_grad_params()} if hasattr(module, "partial_grad_params") else set()
        for name, p in module.named_parameters(recurse=False):
            t = {}
            if tp is not None:
                t["tp"] = "V" if name in shard_dims else "R" if id(p) in declared else "I"
            if "cp" in axes:
                t["cp"] = "R"
            types.setdefault(id(p), t)
            over = {a for a, v in t.items() if v == "R"}
            if over:
                partial[id(p)] = (f"{mod_name}.{name}".lstrip("."), over)
    return types, partial


def _stamp_params(module: nn.Module, args) -> None:
    """Forward pre-hook: type the module's own parameters (FSDP's unsharded ones too, as they are at forward)."""
    session = _session
    if session is None or not _spmd().is_type_checking():
        return
    s = _spmd()
    for name, p in module.named_parameters(recurse=False):
        key = module._spmd_param_keys.get(name)
        t = session.param_types.get(key) if key is not None else None
        if t is None:
            continue
        want = {session.axes[a].group: _t(v) for a, v in t.items()}
        s.assert_type(p, want)  # once per tensor object; a later stamp must agree with the first


def _typed_shard(real):
    @functools.wraps(real)
    def shard(self, x, dim):
        s = _spmd()
        with s.no_typecheck():
            out = real(self, x, dim)
        if _session is None or not s.is_type_checking() or not s.has_local_type(x):
            return out
        have = _type_on(x, self.axis.group)
        if have is not None and have not in (s.R, s.I):
            raise _error("ContextShards.shard: the cp split keeps this rank's tokens of a full sequence, but its "
                         f"input is {have!r} on cp")
        if have is s.I and x.requires_grad:
            raise _error("ContextShards.shard: an I input's gradient must stay I, but the split's backward scatters "
                         "this rank's part into zeros (a pending sum): the input must be R on cp")
        typed = dict(s.get_local_type(x))
        typed[s.MeshAxis.of(self.axis.group)] = s.V
        s.assert_type(out, typed)
        return out
    shard.__typed__ = real
    return shard


def _typed_sum_grads(real):
    @functools.wraps(real)
    def sum_grads(params, axis):
        if _session is not None:
            name = next((n for n, a in _session.axes.items() if a is axis or a.group is axis.group), axis.name)
            for p in params:
                if p.grad is not None:
                    _session.summed.setdefault(id(p), set()).add(name)
        return real(params, axis)
    sum_grads.__typed__ = real
    return sum_grads


def unsummed(model: nn.Module) -> list[str]:
    """Parameters typed R on tp whose (P) gradient reached the optimizer without sum_grads over tp, since
    `checking` began or `reset_sync` (cp's P gradients are summed by DDP/FSDP over dp x cp, not typed here)."""
    assert _session is not None
    s = _spmd()
    missing = []
    for name, p in model.named_parameters():
        entry = _session.partial.get(id(p))
        if entry is None or "tp" not in entry[1] or id(p) not in _session.grads_seen:
            continue
        if "tp" not in _session.summed.get(id(p), set()):
            missing.append(f"{name}: R on tp, so its gradient is {s.R.backward_type()!r} (a pending sum), and it "
                           "reached the optimizer without sum_grads over tp")
    return missing


# ----------------------------------------------------------------------------------------------------------------
# The session


@contextlib.contextmanager
def checking(grid, model: nn.Module) -> Iterator[Session]:
    """Type checking on for `model` (this rank's parts, as built) on `grid`: the mappings, the two other
    communicating Functions, the cp split and the gradient sync are typed until exit. Forward regions to infer
    run in `typed_forward()`."""
    global _session
    import importlib

    import distributed.data_parallel as data_parallel
    from distributed.context import layout, ring
    from distributed.tensor import vocab

    s = _spmd()
    mappings = importlib.import_module(MAPPINGS)
    axes = {name: grid.axis(name) for name in ("tp", "cp") if grid.size(name) > 1}
    types, partial = _param_types(model, axes)
    session = Session(grid, axes, types, partial, {})
    session.grads_seen = set()
    undo: list = []

    def patch(obj, attr, value):
        old = obj.__dict__.get(attr, _MISSING) if isinstance(obj, type) else getattr(obj, attr, _MISSING)
        setattr(obj, attr, value)
        undo.append((obj, attr, old))

    hooks = []
    try:
        for name in SIGNATURES:
            cls = getattr(mappings, name)
            axis_pos = 3 if name == "_AllGatherLinear" else 1
            patch(cls, "spmd_typecheck", staticmethod(_mapping_rule(name)))
            patch(cls, "forward", staticmethod(_remembering_forward(cls.__dict__["forward"].__func__, axis_pos)))
            patch(cls, "backward", staticmethod(_checked_backward(name, cls.__dict__["backward"].__func__)))
        for door in DOORS:
            patch(mappings, door, _typed_door(door, getattr(mappings, door)))
        patch(vocab._VocabParallelCrossEntropy, "spmd_typecheck", staticmethod(_vocab_cross_entropy_rule))
        patch(ring._RingAttention, "spmd_typecheck", staticmethod(_ring_rule))
        for cls, rule in _identity_functions():
            patch(cls, "spmd_typecheck", staticmethod(rule))
        patch(layout.ContextShards, "shard", _typed_shard(layout.ContextShards.shard))
        patch(data_parallel, "sum_grads", _typed_sum_grads(data_parallel.sum_grads))
        for module in model.modules():
            module._spmd_param_keys = {n: id(p) for n, p in module.named_parameters(recurse=False)}
            hooks.append(module.register_forward_pre_hook(_stamp_params))
        for p in model.parameters():
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(lambda q: session.grads_seen.add(id(q))))
        _session = session
        with s.traceback_filtering("off"):
            yield session
    finally:
        _session = None
        for h in hooks:
            h.remove()
        for module in model.modules():
            module.__dict__.pop("_spmd_param_keys", None)
        for obj, attr, old in reversed(undo):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


@contextlib.contextmanager
def typed_forward(inputs: tuple = ()) -> Iterator[None]:
    """A forward region under spmd-types' checking mode (permissive: untyped tensors, such as the model's
    buffers, mix freely). `inputs` (the batch) are typed I on tp and R on cp."""
    s = _spmd()
    assert _session is not None, "typed_forward runs inside checking()"
    with s.checker.typecheck(strict_mode="permissive"):
        for x in inputs:
            if isinstance(x, torch.Tensor) and not s.has_local_type(x):
                s.assert_type(x, {a.group: (s.I if n == "tp" else s.R) for n, a in _session.axes.items()})
        yield


def check_loss(loss: torch.Tensor) -> None:
    """spmd-types' rule for backward() without a gradient: the loss must be I or P on every typed axis."""
    s = _spmd()
    if not s.has_local_type(loss):
        return
    for ax, t in s.get_local_type(loss).items():
        if t not in (s.I, s.P):
            raise _error(f"the loss is {t!r} on {ax}: backward() from a 1.0 gradient needs I or P (a replicated or "
                         "varying loss gives wrong gradients)")
