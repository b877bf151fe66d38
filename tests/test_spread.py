"""The stored spread report (tests/data/spread.json, `python -m tests.spread`) agrees with itself and with the
matrix: its bounds are those `derive` makes of its cases, it was measured at the matrix's STEPS and validation
setting, every (model, precision) pair of the covering set has a measured case, and the fp32 spread is far inside
the layout contract; the matrix (`tolerance`) and the localiser (utils/compare/diverge.py) take their bounds from it."""

from __future__ import annotations

import copy
import json

import pytest

from tests.spread import FP32_BOUND, LOW, REPORT, derive, problems


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


def test_the_stored_bounds_are_those_of_the_stored_cases(report):
    assert problems(report) == []


def test_a_report_that_disagrees_is_named(report):
    """Each way the report can drift from its cases or from the matrix is found (here in memory; the file itself
    edited on purpose fails the test above the same way)."""
    from tests.test_matrix import STEPS

    model, precision = "gpt", "bf16"
    edited = copy.deepcopy(report)
    edited["bounds"]["curves"][model][precision] *= 1.5
    assert any("not those derived" in p for p in problems(edited))
    edited = copy.deepcopy(report)
    edited["cases"] = [c for c in edited["cases"] if c["worst"] != edited["spread"][model][precision]["curves"]]
    assert any("not those derived" in p for p in problems(edited))  # the worst case dropped: a smaller spread
    edited = copy.deepcopy(report)
    edited["artefacts"] = {}
    assert any("not those derived" in p for p in problems(edited))
    edited = copy.deepcopy(report)
    edited["runs"][-1]["steps"] = STEPS + 1
    assert any(f"measured {STEPS + 1} steps per case" in p for p in problems(edited))
    edited = copy.deepcopy(report)
    edited["runs"][-1]["validation"]["gpt"] = ["data.limit_eval_tokens=2048"]
    assert any("validated with" in p for p in problems(edited))
    edited = copy.deepcopy(report)
    edited["cases"] = [c for c in edited["cases"] if (c["model"], c["precision"]) != ("vit", "fp16")]
    edited.update(derive(edited["cases"], edited["margin"]))
    assert problems(edited) == ["no measured case of vit fp16, a pair of the covering set"]


def test_the_matrix_takes_its_bounds_from_the_report(report):
    from tests.test_matrix import MARGIN, tolerance

    assert MARGIN == report["margin"]
    for model, rows in report["bounds"]["curves"].items():
        for precision, bound in rows.items():
            assert tolerance(model, precision) == pytest.approx(bound, rel=1e-3)
            if precision == "fp32":
                assert bound == FP32_BOUND == tolerance(model, precision)
            else:
                assert tolerance(model, precision) == MARGIN * report["spread"][model][precision]["curves"]


def test_the_localiser_takes_its_bounds_from_the_report(report):
    """Per model where it knows it (task.json's arch), else the loosest of the precision; tf32 as fp16; a pass
    at a time (`tolerance`: the loosest pass's)."""
    from utils.compare.diverge import PASSES, bounds, rtol_of, tolerance, tolerances

    table = report["bounds"]["localiser"]
    assert bounds() == table
    for precision in LOW:
        loosest = {kind: max(row[precision][kind] for row in table.values()) for kind in PASSES}
        for model, row in table.items():
            assert rtol_of(precision, model, table) == row[precision]
            assert tolerances({"precision": precision, "model": model}, {"precision": "fp32", "model": model},
                              None) == row[precision]
            assert tolerance({"precision": precision, "model": model}, {"precision": precision, "model": None},
                             None) == max(loosest.values())
        assert rtol_of(precision, None, table) == rtol_of(precision, "toy", table) == loosest
    assert rtol_of("fp32", "vit", table) == dict.fromkeys(PASSES, FP32_BOUND)
    assert rtol_of("tf32", "gpt", table) == table["gpt"]["fp16"]
    assert tolerances({"precision": "bf16", "model": None}, {"precision": "bf16"}, 0.5) == dict.fromkeys(PASSES, 0.5)
