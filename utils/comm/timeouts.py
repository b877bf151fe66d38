"""How long a collective may wait before its backend gives up: one timeout for every process group of the job.

`torch.distributed.init_process_group(timeout=...)` sets the default group's timeout only: groups made after it
(the DeviceMesh's dims, their flattened products, `new_group` pairs, the hierarchical ring's, the gloo side
group) keep the backend's default, 10 minutes on NCCL and 30 on gloo. `set_group_timeouts` gives every group
this process belongs to one timeout: `utils/comm/__init__.py` `init_grid` applies `parallel.init_timeout_s` once every
group of the grid exists, and the step watchdog (utils/engine/watchdog.py) raises it for the training loop to
`watchdog_safe_timeout(trainer.hang_timeout_s)`, so that a hung collective is first seen by the step watchdog
(which writes every thread's stack to hang_rank<r>.txt and exits) and not by NCCL's own watchdog thread, whose
timeout aborts the communicator and kills the process without a stack. NCCL's heartbeat monitor
(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 8 min by default) watches that watchdog thread, not the collectives, so it
does not fire on a hung collective and needs no setting.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

WATCHDOG_MARGIN_S = 120.0  # the step watchdog checks every second and writes its stacks in well under this


def watchdog_safe_timeout(hang_timeout_s: float) -> float:
    """A collective timeout that the step watchdog (`hang_timeout_s`) always beats."""
    return hang_timeout_s + WATCHDOG_MARGIN_S


def _groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of (the default one included); none before init."""
    if not dist.is_initialized():
        return []
    return [pg for pg in dist.distributed_c10d._world.pg_map if pg is not dist.GroupMember.NON_GROUP_MEMBER]


def group_timeouts() -> dict[str, float]:
    """{group name: its timeout in seconds} of every group of this process, as its backends hold it (the
    largest over a group's backends)."""
    out = {}
    for pg in _groups():
        backends = [pg._get_backend(kind) for kind in pg._device_types if kind.type in ("cpu", "cuda")]
        seconds = [b.options._timeout.total_seconds() for b in backends
                   if getattr(b, "options", None) is not None]  # torch's fake group (the planner) has none
        if seconds:
            out[pg.group_name] = max(seconds)
    return out


def set_group_timeouts(seconds: float) -> dict[str, float]:
    """Give every group of this process a `seconds` timeout (no communication: each rank sets its own);
    returns the timeouts they had."""
    before = group_timeouts()
    for pg in _groups():
        if pg.group_name in before:  # a group with a timeout to set (not torch's fake one)
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), pg)
    return before


def restore_group_timeouts(before: dict[str, float]) -> None:
    """Put back the timeouts `set_group_timeouts` returned (groups made since keep theirs)."""
    for pg in _groups():
        if pg.group_name in before:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=before[pg.group_name]), pg)
