"""SPMD types for the parallel mappings: the second oracle (tests/typecheck.py runs it; docs/testing.md).

Each autograd Function of `distributed/mappings.py`, and the two other Functions that communicate inside the
model, gets a type signature on the axis it is given, in the local SPMD types of meta-pytorch's spmd-types
(PyPI `spmd-types`, a test-only dependency). Per mesh axis a tensor is R (replicated; its gradient a pending
sum, P), I (invariant: replicated, its gradient too), V (varying: per-rank values, S(d) when sharded along d;
gradient V) or P (a pending sum; gradient R). Forward signatures (`SIGNATURES`; "P|V": a pending sum, or a
varying local result read as one, as spmd-types' all_reduce(src=V) allows):

    copy_to_region I -> R (Megatron f)          reduce_from_region P|V -> I (Megatron g)
    scatter_to_region I -> S(d)                 gather_from_region S(d) -> I
    all_gather_region S(d) -> R                 reduce_scatter_region P|V -> S(d)
    all_gather_linear x: S(d) -> R, then x @ W^T + b with W, b V -> V
    sequence_to_heads S(2) -> S(1)              heads_to_sequence S(1) -> S(2)
    vocab-parallel cross-entropy logits V -> per-token loss I; ring attention q, k, v V -> V
    ContextShards.shard (the cp split) R -> S(d) on cp (its backward scatters: V -> P)

Inside `checking(grid)`, `typed_forward()` regions run under spmd-types' checking mode, which infers every torch
op's type from its operands and raises SpmdTypeError where they do not combine (I with V or P, P through a
non-linear op, ...); each mapping checks its input against its signature and stamps its output. spmd-types
trusts a Function's backward, so each mapping's backward is checked here: the incoming gradient is typed the
backward type of the forward output, the body runs in the checking mode with the collectives it calls typed
(`DOORS`), and each returned gradient must have the backward type of its input (R and I count as one: the
same value on every rank). Hierarchical cp's all-to-all group and ring are typed as cp (sub-axes of it).

Off by default: nothing imports spmd-types or patches anything until `checking` is entered, and
distributed/mappings.py is unchanged (class attributes set inside `checking`, removed at its exit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

MAPPINGS = "distributed.mappings"
# Function class in distributed.mappings -> (forward input type, output type) on its axis. "S" is S(dim) of the
# call; "P|V": a pending sum, or a varying local result read as one (spmd-types' all_reduce(src=V)).
SIGNATURES = {
    "_CopyToRegion": ("I", "R", "copy_to_region"),
    "_ReduceFromRegion": ("P|V", "I", "reduce_from_region"),
    "_ScatterToRegion": ("I", "S", "scatter_to_region"),
    "_GatherFromRegion": ("S", "I", "gather_from_region"),
    "_AllGatherRegion": ("S", "R", "all_gather_region"),
    "_AllGatherLinear": ("S", "V", "all_gather_linear"),
    "_ReduceScatterRegion": ("P|V", "S", "reduce_scatter_region"),
    "_SequenceToHeads": ("S2", "S1", "sequence_to_heads"),
    "_HeadsToSequence": ("S1", "S2", "heads_to_sequence"),
}
# The collectives the mappings' backwards call (names in distributed.mappings), typed while a backward is checked.
_UNREDUCED = ": a pending sum left unreduced (a missing all-reduce or reduce-scatter)"
DOORS = ("all_reduce", "all_gather", "reduce_scatter", "own_chunk", "all_to_all")


@dataclass
class Session:
    axes: dict  # axis name ('tp', 'cp') -> AxisGroup of size > 1
    backward_checks: int = 0
    in_backward: int = 0  # depth of checked backward bodies (the doors are typed there only)
    undo: list = field(default_factory=list)  # (object, attribute, old value or _MISSING)

    def patch(self, obj, attr: str, value) -> None:
        """Set obj.attr (a class's own attribute, a module's global) to value until `checking` exits."""
        old = obj.__dict__.get(attr, _MISSING) if isinstance(obj, type) else getattr(obj, attr, _MISSING)
        setattr(obj, attr, value)
        self.undo.append((obj, attr, old))


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
    return a is b or {a, b} <= {_spmd().R, _spmd().I}


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
    src_spec, dst_spec, _ = SIGNATURES[name]

    def transition(x, group, dim):
        rules = _spmd().rules
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
        return rules.convert(x, group, src=src, dst=dst)

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


# ----------------------------------------------------------------------------------------------------------------
# Backward checks


def _grad_types(name: str, ctx):
    """(type of the incoming gradient, expected type of the input gradient) on the Function's axis."""
    src_spec, dst_spec, _ = SIGNATURES[name]
    out = _t("V" if dst_spec.startswith("S") else dst_spec)
    inp = _t("P" if src_spec == "P|V" else "V" if src_spec.startswith("S") else src_spec)
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
        try:
            with s.checker.typecheck(strict_mode="permissive"):
                result = real(ctx, *typed)
        finally:
            _session.in_backward -= 1
        _session.backward_checks += 1
        outs = result if isinstance(result, tuple) else (result,)
        for i, (g, want) in enumerate(zip(outs, _input_grad_types(name, expected))):
            if not isinstance(g, torch.Tensor) or want is None:
                continue
            have = _type_on(g, group)
            if have is None or not _same_value(have, want):
                raise _error(f"{_public(name)} backward on {axis.name}: the gradient of input {i} is "
                             f"{have if have is not None else 'untyped'} but must be {want!r} (the backward type of "
                             f"its forward type)" + (_UNREDUCED if have is s.P else ""))
        return result
    return backward


def _input_grad_types(name: str, expected):
    s = _spmd()
    if name == "_AllGatherLinear":
        return (expected, s.V, s.V)  # dX, dW and db (the weight and bias are column shards: V)
    return (expected,)


def _public(name: str) -> str:
    return SIGNATURES[name][2]


def _remembering_forward(real, axis_pos: int):
    @functools.wraps(real)
    def forward(ctx, *args):
        ctx._spmd_axis = args[axis_pos]
        return real(ctx, *args)
    return forward


# ----------------------------------------------------------------------------------------------------------------
# The cp split


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
    return shard


# ----------------------------------------------------------------------------------------------------------------
# The session


@contextlib.contextmanager
def checking(grid) -> Iterator[Session]:
    """Type checking on over `grid`'s tp and cp axes: the mappings, the two other communicating Functions and the
    cp split are typed until exit (`Session.patch` adds more, undone at exit too). Forward regions to infer run
    in `typed_forward()`."""
    global _session
    session = Session({name: grid.axis(name) for name in ("tp", "cp") if grid.size(name) > 1})
    try:
        _install(session.patch)
        _session = session
        with _spmd().traceback_filtering("off"):
            yield session
    finally:
        _session = None
        for obj, attr, old in reversed(session.undo):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


def _install(patch) -> None:
    import importlib

    from distributed.context import layout, ring
    from distributed.tensor import vocab

    mappings = importlib.import_module(MAPPINGS)
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
    patch(layout.ContextShards, "shard", _typed_shard(layout.ContextShards.shard))


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
