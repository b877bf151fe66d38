"""SPMD types, the second oracle (distributed/typecheck/spmd_typing.py, tests/typecheck.py): one training step
per layout in one process on a fake group, typed; the plants the types catch alone. `python -m tests.typecheck`
checks every layout of the covering set and `--plants` every plant (docs/testing.md, "SPMD types: the second
oracle")."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("spmd_types")  # the test extra of pyproject.toml

from tests import typecheck  # noqa: E402

# One layout per distinct typed combination of the covering set (tp or not x cp variant x sequence parallelism),
# the cheapest of each; a pp case is typed with its pipeline folded (tests/typecheck.py `folded`).
LAYOUTS = (
    "gpt-dp4-bf16-ddp-ac-acc1",
    "gpt-tp2dp2-bf16-oppdpcptp-ddp-sp0-ac-acc1",
    "llama-tp2pp2-fp32-oppdpcptp-zbv-sp1-acc1",
    "gpt-cp2-fp32-ddp-allgather-ac-acc2",
    "gpt-cp2pp2-fp32-oppdpcptp-ddp-gpipe-ring-ac-acc1",
    "gpt-cp2dp2-bf16-oppdpcptp-ddp-alltoall-ac-acc1",
    "vit-cp4-fp32-ddp-hierarchical-a2a2-ac-acc1",
    "gpt-tp2cp2-bf16-oppdpcptp-ddp-allgather-sp0-ac-acc1",
    "gpt-tp2cp2-bf16-oppdpcptp-fsdp-allgather-sp1-ac-acc1",
    "gpt-tp2cp2-bf16-oppdpcptp-ddp-ring-sp0-ac-acc1",
    "vit-tp2cp2-bf16-otpcpdppp-ddp-ring-sp1-ac-acc2",
    "llama-tp2cp2-fp32-otpcpdppp-fsdp-alltoall-sp0-acc2-docs",
    "gpt-tp2cp2-bf16-oppdpcptp-ddp-alltoall-sp1-ac-acc1",
)
# Plant -> (a target layout, what the type error names): the plants the types catch alone.
CAUGHT = {
    "tp_copy_skips_grad_sum": ("gpt-tp2dp2-bf16-oppdpcptp-ddp-sp0-ac-acc1", "copy_to_region backward"),
    "sp_gather_linear_keeps_own_chunk": ("llama-tp2pp2-fp32-oppdpcptp-zbv-sp1-acc1", "own_chunk over tp"),
    "cp_allgather_key_grads_unsummed": ("gpt-cp2-fp32-ddp-allgather-ac-acc2", "Invariant type"),
    "partial_grads_skip_vectors": ("llama-tp2pp2-fp32-oppdpcptp-zbv-sp1-acc1", "gradient sync"),
}


def _case(name: str):
    found = [c for c in typecheck.covering_cases() if c.name == name]
    if not found:
        pytest.skip(f"{name} is no longer in the covering set (tests/matrix.py): choose another layout")
    return found[0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layouts_step_type_checks(name):
    verdict = typecheck.check_case(_case(name))
    assert verdict.status == "passed", verdict.line()


def test_the_representatives_cover_every_typed_combination():
    """Each (tp, cp variant, sequence parallelism) of the covering set has a layout in LAYOUTS."""
    def key(c):
        return c.tp > 1, c.cp_attention, c.sequence_parallel

    cases = {c.name: c for c in typecheck.covering_cases()}
    assert {key(c) for c in cases.values()} <= {key(cases[n]) for n in LAYOUTS if n in cases}


@pytest.mark.parametrize("plant", sorted(CAUGHT))
def test_the_types_catch_the_plant_alone(plant):
    from tests.planted_bugs import locate

    name, expected = CAUGHT[plant]
    with typecheck.planted(locate(plant)):
        verdict = typecheck.check_case(_case(name))
    assert verdict.status == "type error" and expected in verdict.detail, verdict.line()


def test_every_mapping_function_has_a_signature():
    import torch

    from distributed import mappings
    from distributed.typecheck import spmd_typing

    functions = {n for n, v in vars(mappings).items() if isinstance(v, type) and issubclass(v, torch.autograd.Function)}
    assert functions == set(spmd_typing.SIGNATURES)


def test_checking_is_off_by_default_and_undone_on_exit():
    """A normal run neither imports spmd-types nor sees the rules; `checking` removes every patch at exit."""
    import subprocess

    probe = ("import sys, distributed.mappings, distributed.typecheck.spmd_typing, distributed.tensor.layers, "
             "distributed.context.attention; print('spmd_types' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=typecheck.ROOT,
                          check=True).stdout.strip() == "False"
    from distributed import mappings
    from distributed.typecheck import spmd_typing
    from utils.comm import Grid

    before = {n: dict(vars(getattr(mappings, n))) for n in spmd_typing.SIGNATURES}
    doors = {n: getattr(mappings, n) for n in spmd_typing.DOORS}
    with spmd_typing.checking(Grid.serial()):
        assert all("spmd_typecheck" in vars(getattr(mappings, n)) for n in spmd_typing.SIGNATURES)
    assert before == {n: dict(vars(getattr(mappings, n))) for n in spmd_typing.SIGNATURES}
    assert doors == {n: getattr(mappings, n) for n in spmd_typing.DOORS}
