"""The shape of the house: one counted door for communication, small files and functions.

Read from the source with `ast`, so a collective hidden behind an alias (`import torch.distributed as
xyz`, `from torch.distributed import all_reduce`) is found as well as `dist.all_reduce`.
"""

from __future__ import annotations

import ast
import re
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


def import_lines(tree: ast.Module, known: set[str]) -> set[tuple[int, str]]:
    """(line, project module) of every import of a module: at its top, inside functions, under
    `if TYPE_CHECKING:` and in its `__main__` block alike (a `__main__` block that imports upward is a command
    that belongs to the layer it imports: move it there)."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {(node.lineno, node.module)} | {(node.lineno, f"{node.module}.{a.name}") for a in node.names}
    resolved = set()
    for line, name in found:  # `from utils.comm import Grid` -> utils.comm; `import utils.cli.runs` -> utils.cli.runs
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            resolved.add((line, name))
    return resolved


def imported_modules(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports, wherever in it (`import_lines`)."""
    return {name for _, name in import_lines(tree, known)}


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


# The layers, bottom first (docs/architecture.md "Layers" states the same table). A module may import modules of
# its own layer and of the layers below, never of a layer above. A module belongs to the longest entry that is
# its name or a dotted prefix of it: `utils` alone is the package's own __init__.py (and any new module placed
# in utils/ itself, until it is given a line). Every file sits in its folder's layer: no entry moves a module of
# a placed package to another layer (`test_every_file_sits_in_its_folders_layer`).
LAYERS = (
    ("base", ("utils", "utils.schema", "utils.launch_env", "utils.signals", "utils.startup")),
    ("models", ("networks",)),
    ("grid", ("utils.comm",)),
    ("parallel", ("distributed",)),
    ("data", ("utils.data", "utils.weather.data", "utils.language.data")),
    ("workloads", ("utils.tasks", "utils.checkpoints", "utils.weather.task", "utils.language.task")),
    ("engine", ("utils.engine",)),
    ("command line", ("utils.cli",)),
    ("tools", ("utils.plan", "utils.bench", "utils.doctor",
               "utils.compare", "utils.forecast", "utils.export", "utils.generate", "utils.evaluate")),
    ("scripts", ("train", "train_mp")),
)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module's layer (None: in no layer)."""
    entries = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(entries)[1] if entries else None


def upward_imports(imports: dict[str, set[tuple[int, str]]], files: dict[str, str]) -> list[str]:
    """'file:line: module (layer) imports module (higher layer)' for every import of a layer above its importer's,
    and 'module: in no layer' for a module LAYERS does not place."""
    found = []
    for module, lines in sorted(imports.items()):
        own = layer_of(module)
        if own is None:
            found.append(f"{files[module]}: {module} is in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for line, target in sorted(lines):
            if (layer_of(target) or 0) > own:
                found.append(f"{files[module]}:{line}: {module} ({LAYERS[own][0]}) imports {target} "
                             f"({LAYERS[layer_of(target)][0]}), a layer above")
    return found


def test_no_module_imports_a_layer_above_its_own():
    """Imports point down the layers of LAYERS, wherever they are written (functions and `__main__` included)."""
    modules = {module_name(p): p for p in source_files()}
    imports = {name: {(line, m) for line, m in import_lines(ast.parse(p.read_text()), set(modules)) if m != name}
               for name, p in modules.items()}
    upward = upward_imports(imports, {name: str(p.relative_to(ROOT)) for name, p in modules.items()})
    assert not upward, "imports up the layers (tests/test_architecture.py LAYERS):\n" + "\n".join(upward)


def test_the_layer_check_finds_upward_imports():
    imports = {"utils.comm": {(3, "utils.cli.launch"), (4, "utils.schema")}, "networks.vit": {(9, "utils")},
               "distributed.mappings": {(7, "utils.comm")}, "elsewhere": set()}
    files = {name: name.replace(".", "/") + ".py" for name in imports}
    assert upward_imports(imports, files) == [
        "elsewhere.py: elsewhere is in no layer (add it to LAYERS and docs/architecture.md)",
        "utils/comm.py:3: utils.comm (grid) imports utils.cli.launch (command line), a layer above"]
    assert layer_of("distributed.pipeline.stage_plan") == 3 == layer_of("distributed.pipeline.stages")
    assert layer_of("utils") == 0 and layer_of("utils.cli.runs") == 7


def test_every_file_sits_in_its_folders_layer():
    """A folder is one layer, as a reader of the tree takes it: an entry inside a placed package (other than the
    package `utils` itself, whose own modules are the base) is in that package's layer."""
    moved = [f"{prefix} ({LAYERS[layer_of(prefix)][0]}) inside {parent} ({LAYERS[layer_of(parent)][0]})"
             for _, prefixes in LAYERS for prefix in prefixes
             for parent in [".".join(prefix.split(".")[:n]) for n in range(1, prefix.count(".") + 1)]
             if parent != "utils" and any(parent in p for _, p in LAYERS) and layer_of(parent) != layer_of(prefix)]
    assert not moved, "modules placed in another layer than their folder's:\n" + "\n".join(moved)


WINGS = ("utils.weather", "utils.language")
CORE = ("utils", "utils.schema", "utils.launch_env", "utils.signals", "utils.startup", "utils.comm", "utils.data",
        "utils.tasks", "utils.checkpoints", "utils.engine", "utils.cli", "networks", "distributed")


def test_the_core_imports_no_wing():
    """The core (the grid, the data interface, the task protocol and registry, checkpoints, the engine, the command
    line, the models and the parallelism) imports nothing of the weather and language wings: it finds their tasks
    (utils/tasks/__init__.py `tasks`) and names their commands as text (utils/data/prepare.py)."""
    graph = import_graph()
    core = [m for m in graph if any(m == c or (c != "utils" and m.startswith(c + ".")) for c in CORE)]
    found = [f"{m} -> {t}" for m in sorted(core) for t in sorted(graph[m])
             if any(t == w or t.startswith(w + ".") for w in WINGS)]
    assert not found, "the core imports a wing:\n" + "\n".join(found)


def documented_layers() -> list[tuple[str, tuple[str, ...]]]:
    """docs/architecture.md's table of layers, bottom first, as LAYERS spells it (a row without a layer name
    continues the one above it; a parenthesis is a remark)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| ([a-z ]*?) *\| (.*?) *\|$", text.split("## Layers", 1)[1], re.M)[1:]  # [0]: the header
    layers: list[tuple[str, list[str]]] = []
    for name, cell in rows:
        paths = re.findall(r"[\w/]+(?:\.py|/)", re.sub(r"\(.*?\)", "", cell))
        modules = [p.removesuffix("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in paths]
        if name:
            layers.append((name, modules))
        else:
            layers[-1][1].extend(modules)
    return [(name, tuple(modules)) for name, modules in reversed(layers)]


def test_the_documented_layers_are_the_checked_ones():
    assert documented_layers() == [(name, tuple(modules)) for name, modules in LAYERS]


def test_no_library_module_imports_a_script():
    graph = import_graph()
    assert not {name for name, deps in graph.items() if deps & {"train", "train_mp"}}


def test_utils_holds_the_bottom_and_subpackages_by_concern():
    """Only the bottom of the layers sits in utils/ itself: the bad-input error (__init__.py), the config schema,
    the launch environment, the stop signals, the collector at a script's start; the grid is utils/comm/ (its
    package holds the grid and, in __main__.py, its command); everything else is in a subpackage that says what
    it holds: the core's by concern, and the two wings (weather, language), each its data and its task below the
    layers of the core that read them."""
    loose = sorted(p.name for p in (ROOT / "utils").glob("*.py"))
    assert loose == ["__init__.py", "launch_env.py", "schema.py", "signals.py", "startup.py"]
    packages = sorted(p.parent.name for p in (ROOT / "utils").glob("*/__init__.py"))
    assert packages == ["bench", "checkpoints", "cli", "comm", "compare", "data", "doctor", "engine", "evaluate",
                        "export", "forecast", "generate", "language", "plan", "tasks", "weather"]
    for wing in ("weather", "language"):
        assert sorted(p.parent.name for p in (ROOT / "utils" / wing).glob("*/__init__.py")) == ["data", "task"]
