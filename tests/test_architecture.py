"""The shape of the house: one counted door for communication, small files and functions.

Read from the source with `ast`, so a collective hidden behind an alias (`import torch.distributed as
xyz`, `from torch.distributed import all_reduce`) is found as well as `dist.all_reduce`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

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


# ------------------------------------------------------------------------------------------ the import graph

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports, at its top or inside functions. A `__main__` guard is left out:
    it runs in the module started as a script (`python -m utils.comm`), a module object of its own, so what
    it imports cannot import it back half-initialized."""
    def is_main_guard(node: ast.AST) -> bool:
        return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'

    found: set[str] = set()
    todo = [n for n in tree.body if not is_main_guard(n)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        todo.extend(ast.iter_child_nodes(node))
    resolved = set()
    for name in found:  # `from utils.comm import Grid` -> utils.comm; `import utils.cli.runs` -> utils.cli.runs
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            resolved.add(name)
    return resolved


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in source_files()}
    return {name: imported_modules(ast.parse(p.read_text()), set(modules)) - {name} for name, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_distributed_imports_nothing_above_it_but_the_grid():
    """distributed/ sits under the engine: from utils it imports the grid (utils.comm) and the bad-input
    error (utils), nothing else; networks/ imports neither the engine nor distributed/."""
    graph = import_graph()
    upward = {name: sorted(m for m in deps if m.startswith("utils") and m not in ("utils", "utils.comm"))
              for name, deps in graph.items() if name.startswith("distributed")}
    assert not {k: v for k, v in upward.items() if v}
    models = {name: sorted(m for m in deps if not m.startswith("networks") and m != "utils")
              for name, deps in graph.items() if name.startswith("networks")}
    assert not {k: v for k, v in models.items() if v}


def test_no_library_module_imports_a_script():
    graph = import_graph()
    assert not {name for name, deps in graph.items() if deps & {"train", "train_mp"}}


def test_utils_holds_the_grid_and_subpackages_by_concern():
    """Only the grid (utils/comm.py) and the bad-input error (utils/__init__.py) sit in utils/ itself;
    everything else is in a subpackage that says what it holds."""
    loose = sorted(p.name for p in (ROOT / "utils").glob("*.py"))
    assert loose == ["__init__.py", "comm.py"]
    packages = sorted(p.parent.name for p in (ROOT / "utils").glob("*/__init__.py"))
    assert packages == ["bench", "checkpoints", "cli", "compare", "data", "doctor", "engine", "forecast", "plan",
                        "tasks"]
