"""The docs are checked: every shell command in README.md and docs/**/*.md code blocks is run at tiny
settings or listed in NOT_RUN with the reason it is not, and every repo path, config key and python module
the docs name exists.

Running a command means its cheap form:
- `python train.py`, `train_mp.py`, torchrun/srun of train.py, and the tools that take config overrides
  (`utils.bench`, `utils.plan`, `utils.plan.rank`, `utils.doctor`): the config of its overrides composed and
  validated as `python train.py <overrides> --cfg` does (`load_config`; a sweep's every point), in process;
- the other tools (`utils.compare`, `utils.export`, `utils.forecast`, `utils.bench.attention`,
  `utils.bench.collectives`): their `main` with the command's own arguments and `--help` appended, in process
  (a subcommand the tool does not have fails);
- the slow test: the commands that launch nothing (`python -m utils.plan.layout ...`, the dry plan of
  `python -m utils.plan ... --json`, `python train.py --cfg`) as subprocesses, as written.

Named things: a repo path (a file or folder under a top-level folder of the project, a markdown link or
image), a config key (`group=option` against config/<group>/, `section.key` against the keys of each model and
data preset composed), a python module (`python -m x.y`, and a dotted name of the project
`utils.cli.config.load_config`: the module's file and the name defined at its top), a test named as
`tests/test_x.py::test_name`. A family module the docs name in `DLSCALE_FAMILIES=...` is added as the variable
adds it: its command composes, its presets are choices. Hydra's own keys (`hydra.*`, `hydra/launcher=`) are not
checked. Both tests print their counts on the terminal.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
SECTIONS = ("model", "data", "precision", "parallel", "optim", "trainer", "run")
GROUPS = ("model", "data", "precision", "parallel", "optim", "experiment")
TOP = ("config", "networks", "distributed", "utils", "submit", "tests", "docs", ".ci")
CONFIG_TOOLS = ("utils.bench", "utils.plan", "utils.plan.rank", "utils.doctor")
HELP_TOOLS = {  # module -> the module whose main(argv) `python -m module` calls
    "utils.compare": "utils.compare.report", "utils.export": "utils.export.convert",
    "utils.forecast": "utils.forecast.report", "utils.generate": "utils.generate.command",
    "utils.bench.attention": "utils.bench.attention",
    "utils.bench.collectives": "utils.bench.collectives", "utils.data.stats": "utils.weather.data.stats",
    "utils.data.era5_zarr_synthetic": "utils.weather.data.era5_zarr_synthetic",
    "utils.data.prepare": "utils.language.data.prepare",
    "utils.evaluate": "utils.evaluate.command"}
# run as written (slow)
DRY = ("python -m utils.comm ", "python -m utils.plan.layout ", "python -m utils.plan parallel=",
       "python train.py --cfg")
# Commands not run, by the start of the command: the reason.
NOT_RUN = {
    "pip install": "installs packages (.ci/run installs the project from scratch)",
    "python -m pytest": "the test suite itself, of which this test is part",
    "python -m tests.planted_bugs": "the plant tier, which CI runs after the suite (.ci/run); "
                                    "tests/test_planted_bugs.py checks that every plant fits the code",
    "python -m tests.typecheck": "type-checks every covering-set layout (about 45 s per rank); "
                                 "tests/test_typecheck.py runs 13 representative layouts and the plants it catches",
    "python -m tests.spread": "runs the matrix's correct layouts (minutes); tests/test_spread.py checks the stored "
                              "report and the bounds derived from it",
    "sbatch": "needs Slurm; tests/test_submit.py runs every script through a stand-in srun",
    "salloc": "needs Slurm",
    "export ": "sets a variable of the shell",
    "CKPT=": "sets a variable of the shell (used by the next lines)",
    "tensorboard": "starts a server",
    "python -c \"import transformers": "needs an exported Hugging Face folder (tests/test_hf.py does this)",
}
# Commands not run, by a part of the command: the reason.
NEEDS = {
    "data.tokenizer=hf/": "needs the Hugging Face folder hf/llama on disk (tests/test_hf.py and "
                          "tests/test_tokenizer_folder.py train from such folders)",
}
MODULE_RUN = r"(?:python|torchrun)[^\n`|]*? -m ([A-Za-z_][\w.]*)(?![\w.=,])"  # not a sweep's -m key=a,b
TEST_NAME = r"((?:tests|utils|distributed|networks)/[\w/]+\.py)::(\w+)"  # tests/test_x.py::test_name
FILE_NAME = (".json", ".yaml", ".pt", ".py", ".md", ".npy", ".h5", ".txt")  # `model.safetensors.index.json`
BAD_EXAMPLES = {("model", "nope")}  # presets the docs name as bad input (docs/configuration.md's sweep errors)
SYNOPSIS = re.compile(r"\[\w+=\.\.\.\]|\.\.\.$|=a,b")  # a usage line, not a command: `[model=...]`, `key=a,b ...`
# A family the docs add from outside the tree (`DLSCALE_FAMILIES=tests.toy_family python train.py model=toy_tiny`):
# added in this process as the variable adds it, so its command composes and its presets are choices too
FAMILIES_VAR = re.compile(r"(?<![\w$])DLSCALE_FAMILIES=([A-Za-z_][\w.]*(?:,[A-Za-z_][\w.]*)*)")


@dataclass(frozen=True)
class Command:
    doc: str
    text: str  # one command, continuation lines joined, trailing comment removed
    error: str = ""  # the `error: ...` line the doc shows it printing (a bad-input example), without `error: `

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _strip_comment(line: str) -> str:
    """The line without its trailing `  # comment` (a # inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands() -> list[Command]:
    """Every shell command of every bash/sh/plain code block; `a && b` gives two."""
    found = []
    starts = ("python ", "pip ", "torchrun ", "sbatch ", "srun ", "salloc ", "export ", "tensorboard ", "$ python")
    for doc in DOCS:
        for lang, body in _blocks(doc.read_text()):
            if lang not in ("", "bash", "sh"):
                continue
            for name, value in re.findall(r"^([A-Z_]+)=(\S+)", body, re.M):  # CKPT=...: its uses get the value
                body = body.replace(f"${name}", value)
            lines = re.sub(r"\\\n\s*", " ", body).splitlines()
            for line, after in zip(lines, [*lines[1:], ""]):
                line = _strip_comment(line).removeprefix("$ ")
                error = after.removeprefix("error: ") if after.startswith("error: ") else ""
                if line.startswith(starts) or re.match(r"[A-Z_]+=\S", line):
                    found += [Command(doc.relative_to(ROOT).as_posix(), part.strip(), error)
                              for part in line.split("&&")]
    return found


def how(cmd: Command) -> tuple[str, str]:
    """('config' | 'help' | 'dry' | 'listed', reason)."""
    if SYNOPSIS.search(cmd.text):
        return "listed", "a usage line with placeholders, not a command"
    for start, reason in NOT_RUN.items():
        if cmd.text.startswith(start):
            return "listed", reason
    for part, reason in NEEDS.items():
        if part in cmd.text:
            return "listed", reason
    if cmd.text.startswith(DRY):
        return "dry", "launches nothing"
    module = _module_of(cmd.argv)
    if module in HELP_TOOLS:
        return "help", HELP_TOOLS[module]
    if module in CONFIG_TOOLS or "train.py" in cmd.argv or "train_mp.py" in cmd.argv:
        return "config", "the config of its overrides"
    return "unclassified", ""


def add_doc_families(text: str) -> set[str]:
    """Add the family modules `text` names in DLSCALE_FAMILIES=...; the `model=` presets they bring."""
    from utils.tasks.registry import MODEL_PRESETS, add_modules

    for names in FAMILIES_VAR.findall(text):
        add_modules(names.split(","))
    return set(MODEL_PRESETS) if FAMILIES_VAR.search(text) else set()


def _module_of(argv: list[str]) -> str | None:
    return argv[argv.index("-m") + 1] if "-m" in argv and argv[0] in ("python", "torchrun", "srun") else None


def overrides_of(argv: list[str]) -> list[str]:
    """The config overrides of a command line: key=value whose key is a section path or a group, not Hydra's."""
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        if "=" in arg and not arg.startswith("-") and (key in GROUPS or key.split(".")[0] in SECTIONS):
            out.append(arg)
    return out


@pytest.fixture(scope="module")
def config_keys() -> set[str]:
    """Every key path (and its prefixes) of the config composed with each model and each data preset (the
    other groups' presets set keys of the schema that every composition holds)."""
    from omegaconf import OmegaConf

    from utils.cli.config import compose_config, presets

    keys: set[str] = set()

    def walk(node, prefix):
        for k, v in node.items():
            keys.add(prefix + k)
            if isinstance(v, dict):
                walk(v, prefix + k + ".")

    for args in [[], *([f"{g}={p}"] for g in ("model", "data") for p in presets(g))]:
        composed = compose_config(args)
        del composed.hydra
        walk(OmegaConf.to_container(composed, resolve=False), "")
    return keys


@pytest.mark.slow  # over 10 s: the fast tier's 3 minutes
def test_every_command_is_run_or_listed(capsys):
    """Each command of the docs has a way to be run or a reason in NOT_RUN; the config commands compose and
    validate, the tools answer --help after the command's own arguments. Prints the counts."""
    from utils import ConfigError
    from utils.cli.config import load_config, sweep_points

    cmds = list(dict.fromkeys(commands()))  # a command a doc repeats (README's test command) counts once
    kinds = {cmd: how(cmd) for cmd in cmds}
    unclassified = [f"{c.doc}: {c.text}" for c, (kind, _) in kinds.items() if kind == "unclassified"]
    assert not unclassified, "run these at tiny settings or list them in NOT_RUN:\n" + "\n".join(unclassified)
    failures = []
    for cmd, (kind, target) in kinds.items():
        if kind == "config":
            add_doc_families(cmd.text)
            args = overrides_of(cmd.argv)
            points = sweep_points(args) if "-m" in cmd.argv else [args]
            for point in points:
                try:
                    load_config(point)
                    error = ""
                except ConfigError as err:
                    error = str(err)
                if error != cmd.error:  # a bad-input example must print the doc's error line
                    failures.append(f"{cmd.doc}: {cmd.text}\n    error {error!r}, the doc shows {cmd.error!r}")
        elif kind == "help":
            status, out = _help(target, cmd.argv[cmd.argv.index("-m") + 2:])
            if status != 0 or not out.strip():
                failures.append(f"{cmd.doc}: {cmd.text}\n    --help exit {status}: {out[-300:]}")
    run = [c for c, (kind, _) in kinds.items() if kind != "listed"]
    listed = [c for c, (kind, _) in kinds.items() if kind == "listed"]
    with capsys.disabled():
        print(f"\ndocs commands: {len(cmds)}: {len(run)} run ("
              + ", ".join(f"{sum(1 for k, _ in kinds.values() if k == kind)} {kind}"
                          for kind in ("config", "help", "dry"))
              + f"), {len(listed)} listed")
    assert len(run) >= 40 and listed, "the extraction lost the docs' commands"
    assert not failures, "\n".join(failures)


def _help(module: str, args: list[str]) -> tuple[int, str]:
    """main(args + ['--help']) of `module`, in process: (exit status, what it printed)."""
    import importlib

    main = importlib.import_module(module).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main([*args, "--help"])
        except SystemExit as stop:
            status = stop.code or 0
    return int(status or 0), out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four interpreters importing torch: minutes on a loaded 2-core machine
def test_the_commands_that_launch_nothing_run_as_written(tmp_path):
    """`python -m utils.plan.layout ...`, the dry plan `python -m utils.plan ... --json` and `python train.py --cfg`,
    as subprocesses exactly as the docs write them: exit 0 and a layout, a plan or a config printed."""
    dry = [c for c in commands() if how(c)[0] == "dry"]
    assert len(dry) >= 4
    failures = []
    for cmd in dry:
        done = subprocess.run(cmd.argv, cwd=ROOT, capture_output=True, text=True, timeout=600)  # a loaded machine
        printed = done.stdout.strip() and ("--cfg" not in cmd.argv or "trainer:" in done.stdout)
        if done.returncode != 0 or not printed:
            failures.append(f"{cmd.doc}: {cmd.text}: exit {done.returncode}\n{done.stderr[-1500:]}")
    assert not failures, "\n".join(failures)


def _doc_texts() -> list[tuple[Path, str]]:
    return [(doc, doc.read_text()) for doc in DOCS]


def _paths(doc: Path, text: str) -> set[Path]:
    """Repo paths named in the text (root-relative), and markdown link targets (relative to the doc)."""
    found = set()
    tops = "|".join(re.escape(t) for t in TOP)
    names = rf"(?<![\w./-])((?:{tops})/[\w./*<>-]*|README\.md|train\.py|train_mp\.py|pyproject\.toml)"
    for name in re.findall(names, text):
        cut = re.split(r"[<*]", name)[0]
        if cut != name:  # a placeholder (submit/logs/<job name>.out, tests/test_*.py): its folder
            cut = cut.rsplit("/", 1)[0]
        cut = cut.rstrip(".,:")
        if cut.count("/") or cut.endswith((".py", ".md", ".toml")):
            found.add(ROOT / cut)
    for target in re.findall(r"\]\(([^)\s#]+)\)", text):
        if not re.match(r"\w+://", target):
            found.add((doc.parent / target).resolve())
    return found


def _dotted(text: str) -> set[str]:
    """`python -m x.y` modules and backticked dotted names of the project's packages."""
    names = set(re.findall(MODULE_RUN, text))
    names |= set(re.findall(r"`((?:utils|distributed|networks|tests)\.[\w.]+)", text))
    return names


def _defines(module_file: Path, name: str) -> bool:
    tree = ast.parse(module_file.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted_exists(name: str, runnable: bool) -> bool:
    """A module's file (with __main__.py for a package run with -m), or a name defined at a module's top."""
    parts = name.split(".")
    if runnable:
        base = ROOT.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file() or parts[0] == "pytest"
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is not None:  # the module itself, a name at its top, or a method of a class there (Class.method)
            return cut == len(parts) or (len(parts) - cut in (1, 2) and _defines(module, parts[cut]))
    return False


def _keys(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    """(`section.key` names, (group, option) choices) the text sets or names."""
    keys = set(re.findall(rf"(?<![\w./$-])((?:{'|'.join(SECTIONS)})\.[a-z_][\w.]*[a-z0-9_])=", text))
    keys |= set(re.findall(rf"`((?:{'|'.join(SECTIONS)})\.[a-z_][\w.]*[a-z0-9_])`", text))
    keys = {key for key in keys if not key.endswith(FILE_NAME)}
    choices = set()
    for group, options in re.findall(rf"(?<![\w./$-])({'|'.join(GROUPS)})=([\w,]+)", text):
        choices |= {(group, option) for option in options.split(",") if option and (group, option) not in BAD_EXAMPLES}
    return keys, choices


def test_every_path_key_and_module_named_exists(config_keys, capsys):
    """Paths, config keys and modules named anywhere in README.md and docs/ exist."""
    missing, counts = [], {"paths": set(), "keys": set(), "choices": set(), "modules": set()}
    family_presets = add_doc_families("\n".join(text for _, text in _doc_texts()))
    for doc, text in _doc_texts():
        where = doc.relative_to(ROOT).as_posix()
        for path in _paths(doc, text):
            counts["paths"].add(path)
            if not path.exists():
                missing.append(f"{where}: path {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        keys, choices = _keys(text)
        for key in keys:
            counts["keys"].add(key)
            if key not in config_keys:
                missing.append(f"{where}: config key {key}")
        for group, option in choices:
            counts["choices"].add((group, option))
            if not (ROOT / "config" / group / f"{option}.yaml").is_file() and not (
                    group == "model" and option in family_presets):
                missing.append(f"{where}: preset {group}={option}")
        for file, name in re.findall(TEST_NAME, text):
            counts["modules"].add(f"{file}::{name}")
            if not ((ROOT / file).is_file() and _defines(ROOT / file, name)):
                missing.append(f"{where}: {file}::{name}")
        runnable = set(re.findall(MODULE_RUN, text))
        for name in _dotted(text):
            counts["modules"].add(name)
            if not _dotted_exists(name.rstrip("."), name in runnable):
                missing.append(f"{where}: module or name {name}")
    with capsys.disabled():
        print("\ndocs names checked: " + ", ".join(f"{len(v)} {k}" for k, v in counts.items()))
    assert len(counts["paths"]) > 50 and len(counts["keys"]) > 50 and counts["modules"], counts
    assert not missing, "the docs name what does not exist:\n" + "\n".join(sorted(missing))


@pytest.mark.parametrize("text,kind", [
    ("see utils/cli/submitit_job.py", "path"), ("set `trainer.no_such_key`", "key"),
    ("python train.py parallel=tp3", "choice"), ("python -m utils.nothing", "module"),
    ("`utils.cli.config.no_such_function`", "module"), ("tests/test_launch.py::test_no_such_test", "test")])
def test_the_checks_catch_a_missing_name(text, kind, config_keys):
    """Each check fails on a name that does not exist (a missing file, key, preset, module, function)."""
    doc = ROOT / "docs" / "x.md"
    keys, choices = _keys(text)
    found = {
        "path": any(not p.exists() for p in _paths(doc, text)),
        "key": any(k not in config_keys for k in keys),
        "choice": any(not (ROOT / "config" / g / f"{o}.yaml").is_file() for g, o in choices),
        "module": any(not _dotted_exists(n, "-m" in text) for n in _dotted(text)),
        "test": any(not _defines(ROOT / f, n) for f, n in re.findall(TEST_NAME, text)),
    }
    assert found[kind] and sum(found.values()) == 1, found


def test_a_command_that_fails_is_caught():
    """A wrong override fails the config composition; an unknown subcommand fails the tool's --help run."""
    from utils import ConfigError
    from utils.cli.config import load_config

    with pytest.raises(ConfigError):
        load_config(overrides_of(shlex.split("python train.py parallel.no_such_key=2")))
    assert _help("utils.export.convert", ["no-such-subcommand"])[0] != 0
    assert how(Command("x", "python -m utils.unknown_tool x")) == ("unclassified", "")
