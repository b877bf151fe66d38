"""The shape of the house: one counted door for communication, small files and functions.

Read from the source with `ast`, so a collective hidden behind an alias (`import torch.distributed as
xyz`, `from torch.distributed import all_reduce`) is found as well as `dist.all_reduce`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Calls that move data between ranks (c10d, functional collectives, object collectives, point-to-point).
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "permute_tensor",
}
DISTRIBUTED_MODULES = ("torch.distributed", "torch.distributed._functional_collectives")
SOURCE_DIRS = ("distributed", "networks", "utils")
ENTRY_POINTS = ("train.py", "train_mp.py")


def source_files() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return files + [ROOT / name for name in ENTRY_POINTS]


def collective_calls(tree: ast.AST) -> list[str]:
    """Names of torch.distributed collectives this module calls or imports, with their line numbers."""
    aliases: set[str] = set(DISTRIBUTED_MODULES)  # spelled out in full after `import torch`
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith(DISTRIBUTED_MODULES)}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (node.module or "").startswith("torch.distributed") and a.name in COLLECTIVES:
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in DISTRIBUTED_MODULES:
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in aliases:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_collective_outside_distributed():
    """Every collective goes through distributed/, where it is counted in comm/<axis>_bytes."""
    offenders = {}
    for path in source_files():
        if path.relative_to(ROOT).parts[0] == "distributed":
            continue
        calls = collective_calls(ast.parse(path.read_text(), str(path)))
        if calls:
            offenders[str(path.relative_to(ROOT))] = calls
    assert not offenders, f"collectives outside distributed/ (use distributed.collectives): {offenders}"


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.all_reduce(x)",
    "import torch.distributed as d\nd.barrier()",
    "from torch.distributed import broadcast\n",
    "import torch.distributed._functional_collectives as funcol\nfuncol.all_gather_tensor(x, 0, g)",
    "from torch import distributed\ndistributed.send(x, 1)",
    "import torch\ntorch.distributed.broadcast_object_list(objs)",
])
def test_the_scan_finds_hidden_collectives(snippet):
    assert collective_calls(ast.parse(snippet))


def test_the_scan_lets_setup_through():
    assert not collective_calls(ast.parse("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                          "dist.destroy_process_group()\nx.all_reduce = 1\n"))


def test_files_and_functions_are_small():
    """No source file over 400 lines and no function over 50 (the issue's yardstick for one concern each)."""
    too_long = []
    for path in source_files():
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > 400:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 50:
                too_long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
