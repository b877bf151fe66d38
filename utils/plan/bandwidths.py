"""`--bandwidths FILE`: the link bandwidths the doctor measured, read for the planner.

The doctor writes a JSON file of kind "dlscale-bandwidths", version 1:

    {"kind": "dlscale-bandwidths", "version": 1, "date": "...", "device": "...", "backend": "nccl|gloo",
     "world": <int>, "intra_gbs": <float or null>, "inter_gbs": <float or null>,
     "groups": {"<axis>": {"size": <int>, "spans_nodes": <bool>, "busbw_gbs": {"all_reduce": <float>, ...}}}}

The planner takes `intra_gbs` and `inter_gbs` (GB/s per direction inside a node / per GPU between nodes)
in place of the preset's; null keeps the preset's value (a one-node measurement has no inter-node figure).
The per-group figures are the doctor's report; the planner's model has one bandwidth per link kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from utils import ConfigError, require

KIND, VERSION = "dlscale-bandwidths", 1


@dataclass
class Bandwidths:
    """The measured link figures of one doctor run (None: not measured, keep the preset's)."""

    path: str
    intra_gbs: float | None
    inter_gbs: float | None
    device: str = ""
    date: str = ""

    def source(self) -> str:
        """Where the figures come from, for the planner's header line."""
        return f"{self.path}" + (f", {self.device}" if self.device else "") + (f", {self.date}" if self.date else "")


def read_bandwidths(path: str) -> Bandwidths:
    """The doctor's file at `path`; anything else (unreadable, not JSON, another kind or version, a figure
    that is not a positive number or null) is refused with one line naming --bandwidths."""
    fix = "give the bandwidths file the doctor writes (utils/doctor; kind dlscale-bandwidths, version 1)"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise ConfigError(f"cannot read '{path}' ({reason})", "--bandwidths", fix) from None
    require(isinstance(data, dict) and data.get("kind") == KIND, f"'{path}' is not a {KIND} file "
            f"(kind {data.get('kind') if isinstance(data, dict) else type(data).__name__!r})", "--bandwidths", fix)
    require(data.get("version") == VERSION, f"'{path}' is version {data.get('version')!r} of {KIND}; "
            f"this planner reads version {VERSION}", "--bandwidths", fix)
    figures = {}
    for key in ("intra_gbs", "inter_gbs"):
        value = data.get(key)
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
        require(ok, f"'{path}' has {key}={value!r}, not a positive number or null", "--bandwidths", fix)
        figures[key] = None if value is None else float(value)
    return Bandwidths(path, figures["intra_gbs"], figures["inter_gbs"], str(data.get("device") or ""),
                      str(data.get("date") or ""))
