"""The collector at a process's start (utils/startup.py): a script pauses it, its command freezes what the imports
made and collects again; `main` called inside another program leaves that program's collector alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

STATE = "import gc; print(gc.isenabled(), gc.get_freeze_count() > 0)"


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1] + done.stderr[-2000:] * (done.returncode not in (0, 2))


@pytest.mark.parametrize("paused", [True, False], ids=["script", "library"])
def test_train_collects_again_after_its_imports_frozen(paused):
    """train.py's command (`--cfg`: composed after the imports) and train_mp.py's (a grid that does not fit: exit
    2 once the imports are done) resume a paused collector with the imports frozen; not paused, nothing."""
    pause = "from utils.startup import pause_collector; pause_collector(); " if paused else ""
    want = "True True" if paused else "True False"
    assert _python(f"{pause}import train; train.main(['--cfg', 'model=vit_tiny']); {STATE}") == want
    launch = ("from utils.cli.local_launch import launch_main\n"
              "try:\n    launch_main(['parallel=tp2', '--nproc', '3'])\nexcept SystemExit:\n    pass\n")
    assert _python(f"{pause}{launch}{STATE}") == want


def _statements(path: Path) -> list[str]:
    """The module's top-level statements: 'call NAME' for a call of a name, 'import MODULE' for an import."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            out.append(f"call {node.value.func.id}")
        elif isinstance(node, ast.ImportFrom) and node.module != "utils.startup":
            out.append(f"import {node.module}")
    return out


def test_every_tool_pauses_before_its_imports_and_resumes_after():
    """Each `python -m utils.<tool>` (utils/*/__main__.py): pause_collector(), its imports, imports_done(), then
    the tool."""
    tools = sorted(Path(ROOT, "utils").glob("*/__main__.py"))
    assert len(tools) >= 9
    for path in tools:
        steps = _statements(path)
        assert steps[0] == "call pause_collector" and steps[1].startswith("import utils."), (path, steps)
        assert steps[2] == "call imports_done", (path, steps)
