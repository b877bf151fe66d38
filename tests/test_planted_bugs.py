"""The planted bugs (tests/planted_bugs.py) still fit the code: every edit's text occurs exactly once, each
plant targets matrix cases, the mechanisms are distinct, and the pytest plugin tells a comparison from a crash.
The plants themselves run in CI's plant tier (`python -m tests.planted_bugs --first` in .ci/run)."""

from __future__ import annotations

import json

import pytest

from tests.planted_bugs import PLANTS, ROOT, targeted


@pytest.mark.parametrize("name", list(PLANTS))
def test_the_plant_fits_the_code_once(name):
    plant = PLANTS[name]
    for file, old, new in plant.edits:
        assert (ROOT / file).read_text().count(old) == 1, (file, old)
    assert any("_plant_hit(" in new for _, _, new in plant.edits)  # the marker that proves the path ran
    assert targeted(plant), "no matrix case targets the plant"


def test_at_least_twelve_mechanisms():
    assert len({p.mechanism for p in PLANTS.values()}) >= 12


def test_the_plugin_tells_a_comparison_from_a_crash(pytester, monkeypatch, tmp_path):
    """A Mismatch is a 'mismatch', any other failure (an assertion on an exit status included) a 'crash'."""
    outcomes = tmp_path / "outcomes.jsonl"
    monkeypatch.setenv("DLSCALE_PLANT_OUTCOMES", str(outcomes))
    monkeypatch.syspath_prepend(str(ROOT))
    pytester.makepyfile(test_cases="""
import pytest
from tests.matrix import Mismatch

@pytest.mark.parametrize("case", ["curve", "crash", "fine"])
def test_case(case):
    if case == "curve":
        raise Mismatch("loss[2] off")
    if case == "crash":
        raise NameError("precision")
""")
    pytester.runpytest("-p", "tests.planted_bugs", "-p", "no:cacheprovider", "-o", "addopts=")
    kinds = {row["case"]: (row["kind"], row["why"]) for row in map(json.loads, outcomes.read_text().splitlines())}
    assert kinds == {"curve": ("mismatch", "loss[2] off"), "crash": ("crash", "precision"), "fine": ("passed", "")}
