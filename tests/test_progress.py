"""The progress line: the rollout length K it shows and an ETA that follows the curriculum's cost."""

import logging
import time

from utils.engine import logger as logger_module
from utils.engine.logger import Progress


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run(monkeypatch, max_steps: int, work) -> list[str]:
    """Progress lines of a run whose optimizer step s costs work(s) seconds on a fake clock, the first
    one 10 s more (compilation)."""
    clock = [0.0]
    monkeypatch.setattr(logger_module.time, "perf_counter", lambda: clock[0])
    log, lines = logging.getLogger(f"progress_test_{max_steps}"), Lines()
    log.handlers, log.propagate = [lines], False
    log.setLevel(logging.INFO)
    progress = Progress(log, max_steps, log_every=1, is_main=True, work=work)
    for step in range(1, max_steps + 1):
        clock[0] += work(step - 1) + (10.0 if step == 1 else 0.0)
        progress.update(step, 1.0, 1.0, 1e-3)
    return lines.lines


def eta(line: str) -> str:
    return line.rsplit("ETA ", 1)[1]


def test_eta_weighs_the_steps_left_by_the_curriculum(monkeypatch):
    def curriculum(step: int) -> int:  # K = 1, 1, 1, 2, 2, 2, 3, ...
        return min(4, 1 + step // 3)

    lines = run(monkeypatch, 12, curriculum)
    assert eta(lines[0]) == "?"  # one step (compilation included) times nothing
    remaining = sum(curriculum(s) for s in range(2, 12))  # seconds left after step 2 at one second per K
    assert eta(lines[1]) == f"{remaining}s"
    assert eta(lines[-1]) == "0s"
    assert [line.split("K=")[1].split()[0] for line in lines] == [str(curriculum(s)) for s in range(12)]


def test_one_step_tasks_show_no_rollout_length(monkeypatch):
    lines = run(monkeypatch, 5, lambda step: 1)
    assert not any("K=" in line for line in lines)
    assert [eta(line) for line in lines] == ["?", "3s", "2s", "1s", "0s"]


def test_a_long_first_step_says_so_within_seconds():
    log, lines = logging.getLogger("first_step_test"), Lines()
    log.handlers, log.propagate = [lines], False
    log.setLevel(logging.INFO)
    progress = Progress(log, max_steps=10, log_every=1, is_main=True)
    progress.first_step_notice(1, after_s=0.05)
    quick = progress.first_step_notice(2, after_s=0.05)
    quick.cancel()  # a step that ended in time says nothing
    time.sleep(0.3)
    assert [line[:33] for line in lines.lines] == ["step 1 still running after 0 s (t"]
