"""The doctor's verdicts and the report they make: one `Check` per line, a markdown and a JSON file, an exit status.

A check has a class (`KINDS`: environment, bandwidth, mappings, layers, layout), a name, a status (pass, warn or
fail), a one-line detail and its figures (a dict, kept whole in the JSON). The exit status is the sum of the bits
of the classes with a failing check (`EXIT_BITS`: 4, 8, 16, 32, 64), so it says which classes failed and never
collides with 1 (a crash), 2 (bad input, utils.EXIT_BAD_INPUT) or 75 (a stop signal); 0 when nothing failed.
A warning (e.g. links slower than the planner assumes, MFU unknown) is reported and does not fail the run.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("environment", "bandwidth", "mappings", "layers", "layout")
EXIT_BITS = {kind: 4 << i for i, kind in enumerate(KINDS)}  # environment 4 ... layout 64
STATUSES = ("pass", "warn", "fail")


@dataclass
class Check:
    """One line of the report."""

    kind: str  # one of KINDS
    name: str  # what was checked, e.g. 'all_reduce on tp (2 ranks)'
    status: str  # pass | warn | fail
    detail: str = ""  # one line: the figures that decided, or why it failed
    figures: dict = field(default_factory=dict)  # the measured values (JSON)

    def __post_init__(self):
        assert self.kind in KINDS and self.status in STATUSES, (self.kind, self.status)


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def exit_status(checks: list[Check]) -> int:
    """The sum of EXIT_BITS over the classes with a failing check (0 when none failed)."""
    return sum(EXIT_BITS[kind] for kind in {c.kind for c in checks if c.status == "fail"})


def failed_kinds(code: int) -> list[str]:
    """The classes an exit status names (the inverse of `exit_status`)."""
    return [kind for kind, bit in EXIT_BITS.items() if code & bit]


def markdown(checks: list[Check], header: dict) -> str:
    """The report as markdown: the run's facts, then one table row per check, then the verdict."""
    lines = ["# dlscale doctor report", ""]
    lines += [f"- {key}: {', '.join(f'{k} {v}' for k, v in value.items()) if isinstance(value, dict) else value}"
              for key, value in header.items()]
    lines += ["", "| class | check | status | detail |", "|---|---|---|---|"]
    for c in checks:
        status = {"pass": "pass", "warn": "WARN", "fail": "**FAIL**"}[c.status]
        lines.append(f"| {c.kind} | {c.name} | {status} | {c.detail.replace('|', '/')} |")
    code = exit_status(checks)
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines += ["", f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed: "
              + ("exit status 0" if code == 0 else f"exit status {code} ({', '.join(failed_kinds(code))})"), ""]
    return "\n".join(lines)


def default_out_dir(root: str, layout: str) -> Path:
    """outputs/doctor/<layout>-<UTC time> (readable, sortable, one folder per run)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(root) / "doctor" / f"{layout}-{stamp}"


def write_report(out_dir: Path, checks: list[Check], header: dict) -> Path:
    """Write report.md and report.json under `out_dir`; returns the markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(
        {"kind": "dlscale-doctor", "version": 1, **header, "exit_status": exit_status(checks),
         "checks": [asdict(c) for c in checks]}, indent=1) + "\n")
    path = out_dir / "report.md"
    path.write_text(markdown(checks, header))
    return path
