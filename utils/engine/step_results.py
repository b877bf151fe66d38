"""What the host learns of a training step, read without waiting for the step in flight.

A step ends on the device with five scalars: the global-batch loss, the gradient norm, the two verdicts
every rank agreed on (a non-finite value somewhere, a stop signal somewhere) and, agreed with them, the
largest rank's peak host memory. The host needs
them to log and to decide whether to stop, but reading a device tensor (`.item()`) waits for all work
queued before it, which on a GPU drains the queue every step.

`StepResults` copies the five scalars to pinned host memory with one asynchronous copy and an event,
and hands a step's results back `lag` steps later: on CUDA `lag=1`, so the host reads step N-1's
scalars after it has queued step N (the wait is for a step already finished or finishing, and the
device stays busy); on the CPU everything is synchronous and `lag=0`. The lag depends only on the device
type, so every rank reads a step's verdicts at the same step and takes the same decision: a stop signal
seen at step N-1 stops the run after step N, on every rank. `flush=True` reads everything pending
(before validation, a checkpoint or the end).

The skip of a non-finite step itself happens on the device (fused Adam's `found_inf`, see
`Trainer.step_optimizer`), so it never waits for these reads.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class StepResult:
    """One step as the host sees it once its scalars are read."""

    step: int  # optimizer steps completed, counting this one
    lr: float  # the learning rate the step used
    started: float  # perf_counter() when the step began (before its data)
    data_wait_s: float  # time spent waiting for its batch
    comm_bytes: dict[str, int] = field(default_factory=dict)  # bytes this rank sent per axis during the step
    shared_bytes: int = 0  # batch bytes this rank read and broadcast to its tp x cp group
    loss: float = float("nan")
    grad_norm: float = float("nan")
    bad: bool = False  # a non-finite loss or gradient norm on some rank
    stop: bool = False  # some rank had a stop signal when the step began
    host_peak_gib: float = 0.0  # the largest rank's peak resident host memory by the step's backward
    step_time_s: float = 0.0  # from the step's start (or the previous result's read, if later) to its read


class StepResults:
    """A queue of steps whose scalars are on their way to the host (see the module docstring)."""

    def __init__(self, device: torch.device, lag: int | None = None):
        self.device = device
        self.lag = (1 if device.type == "cuda" else 0) if lag is None else lag
        self.pending: deque[tuple[StepResult, torch.Tensor, torch.cuda.Event | None]] = deque()
        self.last_read = 0.0

    def push(self, result: StepResult, scalars: torch.Tensor) -> None:
        """Start copying `scalars` = [loss, grad_norm, bad, stop, host peak GiB] (device, any float dtype) to
        the host."""
        scalars = scalars.detach().float()
        if self.device.type == "cuda":
            host = torch.empty(scalars.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(scalars, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = scalars, None
        self.pending.append((result, host, event))

    def pop(self, flush: bool = False) -> list[StepResult]:
        """The results that are due (all pending ones with `flush`), oldest first, their scalars read."""
        keep = 0 if flush else self.lag
        done = []
        while len(self.pending) > keep:
            result, host, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
            result.loss, result.grad_norm, bad, stop, result.host_peak_gib = host.tolist()
            result.bad, result.stop = bad > 0, stop > 0
            now = time.perf_counter()
            result.step_time_s = now - max(result.started, self.last_read)
            self.last_read = now
            done.append(result)
        return done
