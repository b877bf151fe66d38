"""Python's cyclic garbage collector at a process's start: the standard library only (scripts import this first).

Importing torch and the trainer makes about 335,000 objects that live as long as the process (torch 2.13,
Python 3.11). Left alone, the collector traverses all of them at each full collection while they are being
imported, at every full collection of the run (each time a quarter more objects survive), and once more at
exit. `pause_collector()`, the first line of a script, pauses it; `imports_done()`, once the command's imports
are done, moves everything alive to the permanent generation (`gc.freeze`, which collections skip) and turns
the collector back on: what the run makes is collected as before. Importing torch and exiting takes about a
third less CPU so (docs/measurements.md, "The collector at a process's start"); every rank of every launch
pays it. The garbage the imports leave (about 9,000 objects) stays frozen with them.

Only scripts pause: `train.main(argv)` or a tool's `main` called inside another program leaves that
program's collector as it is (`imports_done` does nothing unless `pause_collector` ran in this process).

`report_fatal_signals()`, also a script's first lines: a process killed by a fatal signal (a C++ abort such as
std::terminate, a segmentation fault) prints the Python stack of the thread that raised it to stderr before it
dies (`<no Python frame>`: a thread of C++ only, such as gloo's), so a rank that dies in a library's C++ says
in the job's log where its Python was; its exit status stays the signal's. Only that thread: walking the
others' stacks while they run (faulthandler's default) crashed the dump itself in 2 of 10 tries here.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import sys

_paused = False  # pause_collector ran and imports_done has not


def pause_collector() -> None:
    """Collect nothing until `imports_done` (the first thing a script does, before its imports)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def run_tool(module: str, *args) -> None:
    """A tool's `__main__.py`: `module` imported with the collector paused, then `sys.exit(module.main(*args))`."""
    pause_collector()
    main = importlib.import_module(module).main
    imports_done()
    sys.exit(main(*args))


def imports_done() -> None:
    """Freeze what is alive and collect again, if `pause_collector` paused the collector; else nothing."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


def report_fatal_signals() -> None:
    """On SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL, dump the signalled thread's Python stack to stderr first."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=False)
