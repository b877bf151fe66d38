"""The pipeline's step results reach the host without draining the GPU's queue (REVIEW D: two host syncs).

On GPUs the stages' compute is timed by CUDA events and the pp-mean idle fraction is reduced on the device;
`Pipeline` reads a step's events one step later and the reduced fraction one step after that, waiting only for
those events (never `torch.cuda.synchronize`, never `.item()` on a tensor of the step in flight). On the CPU
the figures are the step's own. Checked with stand-in events: which ones the host waits for, and when.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from distributed.pipeline import schedule
from distributed.pipeline.schedule import Pipeline
from distributed.pipeline.torch_stages import CountedStage, busy_seconds


class Event:
    """A CUDA event stand-in on a fake clock: `synchronize` records that the host waited for it."""

    waited: list[str] = []

    def __init__(self, name: str, at_ms: float):
        self.name, self.at_ms = name, at_ms

    def synchronize(self) -> None:
        Event.waited.append(self.name)

    def elapsed_time(self, end: Event) -> float:
        return end.at_ms - self.at_ms


def _pipeline(device: str) -> Pipeline:
    pipe = Pipeline.__new__(Pipeline)  # the bookkeeping only: no model, stages or schedule
    pipe.grid = SimpleNamespace(device=torch.device(device))
    pipe._timings, pipe._bubbles = schedule.deque(), schedule.deque()
    return pipe


def test_gpu_step_results_are_read_late_waiting_only_for_finished_steps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a full device synchronize"))
    Event.waited = []
    pipe = _pipeline("cuda")
    for step in (1, 2, 3):  # each step: wall 10 ms from its start mark, 6 ms of compute in one stage
        busy = [(Event(f"busy{step}.start", 100 * step), Event(f"busy{step}.end", 100 * step + 6))]
        start, end = Event(f"step{step}.start", 100 * step), Event(f"step{step}.end", 100 * step + 10)
        pipe._timings.append(([busy], start, end))
        idle = pipe._finished_idle()
        pipe._bubbles.append((torch.tensor(idle), Event(f"reduced{step}", 0)))  # the pp-mean of what it reduced
        bubble = pipe._read_bubble()
        if step == 1:  # nothing of step 1 has been waited for while step 1 is in flight
            assert math.isnan(idle) and math.isnan(bubble) and Event.waited == []
        if step == 2:  # step 1's events, and nothing of step 2
            assert idle == pytest.approx(0.4) and math.isnan(bubble)
            assert Event.waited == ["busy1.end", "step1.end", "reduced1"]
        if step == 3:  # step 2's events; the reduction made at step 2 holds step 1's idle fraction
            assert bubble == pytest.approx(0.4) and Event.waited[3:] == ["busy2.end", "step2.end", "reduced2"]
    assert all(not name.startswith(("busy3", "step3", "reduced3")) for name in Event.waited)


def test_cpu_step_results_are_the_steps_own():
    pipe = _pipeline("cpu")
    pipe._timings.append(([0.25, 0.25], 1.0, 2.0))  # two stages' compute seconds, the step's start and end
    idle = pipe._finished_idle()
    pipe._bubbles.append(schedule._to_host(torch.tensor(idle)))
    assert idle == pytest.approx(0.5) and pipe._read_bubble() == pytest.approx(0.5)


def test_stage_hands_over_its_events_without_waiting():
    stage = CountedStage.__new__(CountedStage)
    stage.device = torch.device("cuda", 0)
    events = [(Event("a", 0.0), Event("b", 3.0)), (Event("c", 5.0), Event("d", 9.0))]
    stage._busy, stage._events = 0.0, list(events)
    Event.waited = []
    taken = stage.take_busy()
    assert taken == events and stage._events == [] and Event.waited == []
    assert busy_seconds(taken) == pytest.approx(7e-3) and Event.waited == ["d"]
