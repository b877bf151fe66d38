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


def _tool_module(path: Path) -> str | None:
    """The module a tool's __main__.py hands to `run_tool` (its one top-level call), or None."""
    calls = [node.value for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    if len(calls) != 1 or getattr(calls[0].func, "id", None) != "run_tool":
        return None
    return calls[0].args[0].value


def test_every_tool_pauses_before_its_imports_and_resumes_after():
    """Each `python -m utils.<tool>` (utils/*/__main__.py) is one `run_tool(<module>)`, which pauses the collector,
    imports the module, freezes what the imports made and collects again, then runs the module's main."""
    tools = sorted(Path(ROOT, "utils").glob("*/__main__.py"))
    assert len(tools) >= 9
    for path in tools:
        module = _tool_module(path)
        assert module is not None and (ROOT / (module.replace(".", "/") + ".py")).is_file(), path
    probe = ("import gc, sys, types\n"
             "sys.modules['probe'] = types.SimpleNamespace(main=lambda: print(gc.isenabled(), gc.get_freeze_count() > 0"
             ", sys.modules['probe'].seen))\n"
             "import importlib\nreal = importlib.import_module\n"
             "def spy(name):\n    sys.modules['probe'].seen = gc.isenabled()\n    return real(name)\n"
             "importlib.import_module = spy\n"
             "from utils.startup import run_tool\nrun_tool('probe')\n")
    assert _python(probe) == "True True False"  # resumed and frozen after; paused while the module imported
