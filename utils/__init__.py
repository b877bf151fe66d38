"""User-facing errors: one line `error: <what> (<setting>): <how to fix>`, exit code 2.

Every check on user input raises `ConfigError`; the entry points turn it into that line on stderr and
exit 2 before any training work. Invariants of our own code stay `assert`s.
"""

import sys

EXIT_BAD_INPUT = 2


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


def require(ok: bool, what: str, setting: str, fix: str) -> None:
    """Raise ConfigError unless `ok`."""
    if not ok:
        raise ConfigError(what, setting, fix)
