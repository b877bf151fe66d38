"""The launch environment: what torchrun, Slurm or `train_mp.py` tell a rank about itself, read by the grid.

`launch_env()` finds rank, world size and local rank in torchrun's variables (RANK/WORLD_SIZE/LOCAL_RANK)
or Slurm's (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), `pick_device` gives the rank its GPU and
`restart_warning` flags a torchrun setting that breaks restarts. It sits below the grid (utils/comm/__init__.py
`init_grid` reads it) and every layer above may read it; the write side, which sets these variables for
local ranks (`rank_env`), is the launcher's (utils/cli/launch.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from utils import require


@dataclass(frozen=True)
class LaunchEnv:
    """Rank, world size and local rank as given by the launcher."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"


def launch_env(environ=os.environ) -> LaunchEnv:
    """Read torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/NTASKS/LOCALID) variables."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)),
                         "torchrun")
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            require(var in environ, f"{var} is not set under Slurm", var,
                    "export MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -n1) and a MASTER_PORT")
        return LaunchEnv(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]),
                         int(environ.get("SLURM_LOCALID", 0)), "slurm")
    return LaunchEnv()


def restart_warning(environ=os.environ) -> str | None:
    """A warning for torchrun --max-restarts when it shares its rendezvous store with the ranks (its
    default): a restarted round can read the previous round's addresses and fail to connect (torch
    issue 135712; here 3 of 4 restarts on CPU/gloo failed with 'Connection refused', none with the fix)."""
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun --max-restarts shares its rendezvous store with the ranks, so a restart can fail to "
                "connect (torch issue 135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")
    return None


def pick_device(local_rank: int) -> torch.device:
    """This rank's GPU, or the CPU when CUDA is not available.

    Every GPU of the node visible: local rank r takes GPU r. Exactly one visible (Slurm's
    `--gpus-per-task=1` or `--gpu-bind=single:1` give each task its own): that one, whatever the rank.
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        index = 0 if count == 1 else local_rank
        require(index < count, f"local rank {local_rank} has no GPU of its own ({count} visible)",
                "launch", f"start at most {count} ranks per node (one per GPU)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
