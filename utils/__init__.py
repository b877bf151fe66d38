"""User-facing errors: one line `error: <what> (<setting>): <how to fix>`, exit code 2.

Every check on user input raises `ConfigError`; the entry points turn it into that line on stderr and
exit 2 before any training work. Invariants of our own code stay `assert`s.
"""

import sys

EXIT_BAD_INPUT = 2
# The oldest torch the code runs on: it uses 2.13's names at import and construction (DDP's forward_sync_buffers,
# DCP's DefaultStager and StagingOptions, FSDP2's set_force_sum_reduction_for_comms).
MIN_TORCH = (2, 13)


class ConfigError(ValueError):
    """Bad user input: names what is wrong, the setting responsible and how to fix it."""

    def __init__(self, what: str, setting: str, fix: str):
        self.what, self.setting, self.fix = what, setting, fix
        super().__init__(f"{what} ({setting}): {fix}")

    def line(self) -> str:
        return f"error: {self}"


def exit_bad_input(err: ConfigError) -> None:
    """Print the one-line error on stderr and exit 2 (no traceback)."""
    print(err.line(), file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def tool_main(doc: str, argv: list[str] | None, run, cleanup=None) -> int:
    """A command-line tool's `main`: `-h`/`--help` prints its docstring `doc`; else `run(argv)` (argv: sys.argv's
    when None), its text (when not None) printed; a ConfigError is the one-line error and exit 2; `cleanup()`
    (e.g. the grid's teardown) runs whatever happens. Returns 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip())
        return 0
    try:
        text = run(argv)
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        if cleanup is not None:
            cleanup()
    if text is not None:
        print(text, flush=True)
    return 0


def require(ok: bool, what: str, setting: str, fix: str) -> None:
    """Raise ConfigError unless `ok`."""
    if not ok:
        raise ConfigError(what, setting, fix)


def require_torch(version: str | None = None) -> None:
    """Refuse (ConfigError) a torch older than MIN_TORCH, or none, before anything imports it: an older one fails
    later with an AttributeError deep in a build. `version`: the installed one (read from the package metadata
    when None, without importing torch)."""
    from importlib import metadata

    need = ".".join(map(str, MIN_TORCH))
    try:
        version = version or metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise ConfigError("torch is not installed", "torch", f"pip install torch=={need}.0 (the CPU build), or a "
                          f"CUDA build of torch>={need}") from None
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    require(release >= MIN_TORCH, f"torch {version} is installed, this code needs torch>={need}", "torch",
            f"pip install 'torch>={need}' (CPU: torch=={need}.0), or use an image that carries it")
