"""The planted bugs (tests/planted_bugs.py) still fit the code: every edit's text occurs exactly once, on the line its
marker `# plant: NAME` marks, wherever the code has moved; no marker names a plant that is gone; each plant targets
matrix cases, the mechanisms are distinct, and the pytest plugin tells a comparison from a crash. The plants
themselves run in CI's plant tier (`python -m tests.planted_bugs --first` in .ci/run)."""

from __future__ import annotations

import json

import pytest

# torch.testing.assert_close imports DTensor lazily: first imported inside the plugin test's nested run, pytester would
# drop it from sys.modules afterwards, and its next import register torch's c10d_functional library twice
import torch.distributed.tensor  # noqa: F401

from tests.matrix import Mismatch
from tests.planted_bugs import PLANTS, ROOT, Misfit, Plant, locate, stale_markers, targeted


@pytest.mark.parametrize("name", list(PLANTS))
def test_the_plant_fits_the_code_once(name):
    """Each edit's fixed text occurs once in the file of the plant's marker, starting on the line it marks."""
    plant = PLANTS[name]
    try:
        locate(name)
    except Misfit as misfit:
        pytest.fail(str(misfit), pytrace=False)
    assert any("_plant_hit(" in new for _, _, new in plant.edits)  # the marker that proves the path ran
    assert targeted(plant), "no matrix case targets the plant"


def test_no_marker_names_an_unknown_plant():
    """A `# plant:` comment whose plant was renamed or removed is stale: it would mislead the next reader."""
    stale = stale_markers()
    assert not stale, "\n".join(stale)


def _tree(tmp_path, monkeypatch, files: dict[str, str], *edits: tuple[str, str, str]):
    """A scratch tree of `files` and a plant `p` of `edits`, for locate and stale_markers."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(PLANTS, "p", Plant("m", "w", edits, lambda c: True))
    return tmp_path


def _misfit(root) -> str:
    with pytest.raises(Misfit) as err:
        locate("p", root)
    return str(err.value)


def test_a_plant_follows_its_marker_to_another_file(tmp_path, monkeypatch):
    """The file a plant names is a hint: the marker's file is the one planted; a marker alone on its line marks the
    next one; one comment may mark several plants."""
    edits = (("a.py", "y = 2", "y = 3"), ("a.py", "\nimport os\n", "\nimport sys\n"))
    moved = '"""doc"""\n# plant: p (next line)\nimport os\n\n\ndef f():\n    y = 2  # plant: p, q\n    return y\n'
    root = _tree(tmp_path, monkeypatch, {"a.py": "x = 1\n", "pkg/b.py": moved}, *edits)
    assert locate("p", root) == (("pkg/b.py", "y = 2", "y = 3"), ("pkg/b.py", "\nimport os\n", "\nimport sys\n"))


@pytest.mark.parametrize("files,expected", [
    ({"a.py": "x = 1  # plant: p\ny = 2\n"},  # the marked line changed, the text is on the next one
     "plant p: its marker `# plant: p` is on a.py:1 but the fixed text `y = 2` is not on that line (it is on "
     "a.py:2): move the marker with the line, or update the plant's text in tests/planted_bugs.py"),
    ({"a.py": "# plant: p (next line)\nx = 1\n", "b.py": "y = 2\n"},  # the line moved, the marker stayed
     "plant p: its marker `# plant: p` is on a.py:1 (for the next line) but the fixed text `y = 2` is not on the "
     "line it marks, a.py:2 (it is on b.py:1): move the marker"),
    ({"a.py": "y = 3  # plant: p\n"},  # the code changed
     "plant p: its marker `# plant: p` is on a.py:1 but the fixed text `y = 2` is not on that line (it occurs "
     "nowhere in the source): update the plant's text in tests/planted_bugs.py"),
    ({"a.py": "y = 2  # plant: p\ny = 2\n"},
     "plant p: its marker `# plant: p` is on a.py:1 but the fixed text `y = 2` occurs 2 times in a.py, not once"),
    ({"a.py": "y = 2\n"},
     "plant p: no marker `# plant: p` in the source (the fixed text `y = 2` is on a.py:1): end the line"),
    ({"a.py": "y = 2  # plant: p\n", "b.py": "z = 1  # plant: p\n"},
     "plant p: its marker `# plant: p` on b.py:1 marks none of the plant's edits (marked on a.py:1): remove"),
], ids=["line-changed", "line-moved", "text-changed", "text-twice", "no-marker", "duplicate-marker"])
def test_a_misfit_names_the_plant_the_marker_and_what_to_do(files, expected, tmp_path, monkeypatch):
    root = _tree(tmp_path, monkeypatch, files, ("a.py", "y = 2", "y = 3"))
    assert _misfit(root).startswith(expected), _misfit(root)


def test_a_stale_marker_is_named(tmp_path, monkeypatch):
    root = _tree(tmp_path, monkeypatch, {"a.py": "y = 2  # plant: p, gone\nz = 1  # plant:\n",
                                         "tests/t.py": "w = 1  # plant: elsewhere\n"}, ("a.py", "y = 2", "y = 3"))
    assert locate("p", root) == (("a.py", "y = 2", "y = 3"),)
    stale = stale_markers(root)
    assert len(stale) == 2 and stale[0].startswith("a.py:1: the marker `# plant: gone` names no plant"), stale
    assert stale[1].startswith("a.py:2: `# plant:` is not a marker"), stale


def test_at_least_twelve_mechanisms():
    assert len({p.mechanism for p in PLANTS.values()}) >= 12


def test_the_plugin_tells_a_comparison_from_a_crash(pytester, monkeypatch, tmp_path):
    """A Mismatch is a 'mismatch' with its margin; outside the matrix's tests an assertion of the test or of a
    testing library is one too (its margin read from the message), while an assert inside the code under test, or
    any other error, is a 'crash'."""
    outcomes = tmp_path / "outcomes.jsonl"
    monkeypatch.setenv("DLSCALE_PLANT_OUTCOMES", str(outcomes))
    monkeypatch.syspath_prepend(str(ROOT))
    pytester.makepyfile(test_cases="""
import pytest
import torch
from tests.matrix import Mismatch

@pytest.mark.parametrize("case", ["curve", "crash", "fine", "close", "exact", "assert", "internal"])
def test_case(case):
    if case == "curve":
        raise Mismatch("loss[2] off", margin=4.0)
    if case == "crash":
        raise NameError("precision")
    if case == "close":
        torch.testing.assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]), rtol=1e-2, atol=0)
    if case == "exact":
        torch.testing.assert_close(torch.tensor([1.0]), torch.tensor([2.0]), rtol=0, atol=0)
    if case == "assert":
        assert 1 == 2, "counts differ"
    if case == "internal":  # an invariant of the code under test (utils/plan/fsdp.py)
        from utils.plan.fsdp import Unit, extend_units
        extend_units((Unit(1, True), Unit(1, False), Unit(1, True)), 2)
""")
    pytester.runpytest("-p", "tests.planted_bugs", "-p", "no:cacheprovider", "-o", "addopts=")
    rows = {row["case"]: row for row in map(json.loads, outcomes.read_text().splitlines())}
    assert {case: row["kind"] for case, row in rows.items()} == {
        "curve": "mismatch", "crash": "crash", "fine": "passed", "close": "mismatch", "exact": "mismatch",
        "assert": "mismatch", "internal": "crash"}
    assert (rows["curve"]["why"], rows["curve"]["margin"]) == ("loss[2] off", 4.0)
    assert rows["crash"]["why"] == "precision"
    # |2.0 - 2.1| = 0.1 against 0 + 1e-2 x 2.1: torch reports the relative difference 0.0476 (up to 0.01 allowed)
    assert rows["close"]["margin"] == pytest.approx(0.1 / 2.1 / 1e-2, rel=1e-3)
    assert rows["exact"]["margin"] == rows["assert"]["margin"] == float("inf")


def _judge(monkeypatch, tmp_path, planted: list[dict], unplanted: dict | None = None, hit: bool = True):
    """Harness.judge on a plant whose matrix run gives `planted` (rows as the plugin writes them) and whose
    unplanted control gives `unplanted`; nothing is copied or run."""
    import tests.planted_bugs as harness

    cases = [(harness.ACCEPTED_TEST, row["case"]) for row in planted] or [(harness.ACCEPTED_TEST, "a")]
    monkeypatch.setattr(harness, "targeted", lambda plant: cases)
    monkeypatch.setattr(harness, "copy_tree", lambda dest: dest.mkdir(parents=True, exist_ok=True))
    monkeypatch.setattr(harness, "plant", lambda tree, edits: None)  # locate runs on the real tree
    runs = []

    def run_cases(tree, wanted, first, marker=None):
        runs.append(tree.name)
        if marker is None:  # the unplanted control
            return [unplanted or {"case": wanted[0][1], "kind": "passed", "why": ""}]
        if hit:
            marker.touch()
        return planted

    monkeypatch.setattr(harness, "run_cases", run_cases)
    verdict = harness.Harness(tmp_path, first=True).judge(next(iter(PLANTS)))
    return verdict, runs


@pytest.mark.parametrize("rows,unplanted,hit,status", [
    ([{"case": "a", "kind": "passed", "why": ""}, {"case": "b", "kind": "mismatch", "why": "loss[1] off"}],
     None, True, "killed"),
    ([{"case": "a", "kind": "passed", "why": ""}, {"case": "b", "kind": "passed", "why": ""}], None, True, "survived"),
    ([{"case": "a", "kind": "crash", "why": "Broken: exit codes [2, 2]"}], None, True, "broken"),
    ([{"case": "a", "kind": "mismatch", "why": "loss[1] off"}], None, False, "broken"),
    ([{"case": "a", "kind": "mismatch", "why": "loss[1] off"}], {"case": "a", "kind": "mismatch", "why": "off too"},
     True, "baseline"),
    ([{"case": "a", "kind": "mismatch", "why": "loss[1] off"}], {"case": "a", "kind": "crash", "why": "boom"},
     True, "baseline"),
    ([{"case": "a", "kind": "skipped", "why": "thin: loss[1] 1.1x"}, {"case": "b", "kind": "passed", "why": ""}],
     None, True, "thin"),
    ([{"case": "a", "kind": "skipped", "why": "thin: loss[1] 1.1x"}, {"case": "b", "kind": "mismatch", "why": "9x"}],
     None, True, "killed"),
], ids=["kill", "survive", "crash-is-broken", "marker-not-hit", "control-fails", "control-crashes", "thin",
        "thin-then-kill"])
def test_the_harness_verdicts(rows, unplanted, hit, status, monkeypatch, tmp_path):
    """A kill needs a Mismatch, the planted code run (the marker) and the killing case passing unplanted; a crash
    is broken, a comparison whose unplanted control fails too is a baseline failure, all passing survives."""
    verdict, runs = _judge(monkeypatch, tmp_path, rows, unplanted, hit)
    assert verdict.status == status, verdict
    killing = next((r for r in rows if r["kind"] in ("mismatch", "crash")), None) or next(
        (r for r in rows if r["kind"] == "skipped"), None)
    assert verdict.case == (killing["case"] if killing else "")
    assert ("unplanted" in runs) == (killing is not None and killing["kind"] == "mismatch")  # only a comparison


def test_the_matrix_verdicts_tell_a_crash_from_a_kill():
    """tests/test_matrix.py: an accepted case exiting 2 on every rank (a torch error re-raised as a ConfigError, the
    NaN stop, a build-time check) is Broken, not a Mismatch; only a refused case that trained is a Mismatch of the
    exit status; an internal assert of a rank is a crash, the attention check's own exception a comparison."""
    from types import SimpleNamespace

    from tests.test_matrix import Broken, assert_exit, attention_verdict

    def ranks(*codes):
        return [SimpleNamespace(value=c, error=None, stdout="", stderr="error: x (y): z") for c in codes]

    for codes, expected, kind in [((2, 2), 0, Broken), ((0, 2), 0, Broken), ((1, 0), 0, Broken),
                                  ((0, 0), 2, Mismatch), ((0, 1), 2, Broken), ((2, 1), 2, Broken)]:
        with pytest.raises(kind) as err:
            assert_exit(ranks(*codes), expected)
        assert type(err.value) is kind, (codes, expected)
    assert_exit(ranks(0, 0), 0)
    assert_exit(ranks(2, 2), 2)
    own = RuntimeError("rank 1 failed:\nTraceback ...\ntests.attention_accuracy.AttentionLessAccurate: rank 1: ring "
                       "attention under bf16 autocast is less accurate than serial SDPA: dV 1.9e-02 > 1.25 x 5.2e-03")
    assert isinstance(attention_verdict(own), Mismatch) and "dV 1.9e-02" in str(attention_verdict(own))
    internal = RuntimeError("rank 0 failed:\nTraceback ...\nAssertionError: the ring's blocks do not line up")
    assert attention_verdict(internal) is internal
