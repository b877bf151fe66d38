"""The few device calls the tools and the ring's blocks share, thin and device-agnostic: on the CPU each is a no-op
or a plain answer (here, under the grid, so that distributed/ can use them too).

- `synchronize(device)`: wait for the device's queued work (CUDA's stream; nothing on the CPU), around every
  host timer that times device work (utils/bench, utils/doctor).
- `free_memory(device)`: collect Python garbage and hand the caching allocator's free blocks back (CUDA), so
  a second model built in the same process sees the memory the first one left.
- `gpu_identity(device)`: what tells one GPU from another across processes: the device UUID, or the PCI
  domain:bus:device when the build does not report the UUID, never the logical index (every rank of a
  per-task binding, `--gpus-per-task=1`, sees its own GPU as cuda:0).
- `compute_capability(device)`: (major, minor) of a CUDA device, None elsewhere.
Tests stub `torch.cuda.get_device_properties`, `torch.cuda.get_device_capability`, `torch.cuda.synchronize` and
`torch.cuda.empty_cache`; what is left untested on the CPU is the driver's own answer.
"""

from __future__ import annotations

import gc

import torch


def synchronize(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (a no-op on the CPU, where work is synchronous)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Free what dropped references still hold: Python's cycles, then (CUDA) the allocator's cached blocks."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def gpu_identity(device: torch.device) -> str:
    """A name of this GPU that differs between GPUs and agrees between processes ('cpu' on the CPU): its UUID,
    else 'pci:<domain>:<bus>:<device>' from the device properties, else 'index:<i>' (then two per-task bound
    ranks cannot be told apart: both would be index 0)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid).strip("0-"):
        return f"uuid:{uuid}"
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        return f"pci:{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}"
    return f"index:{device.index}"


def compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (8.0 A100, 9.0 H100/H200, 7.0 V100, 7.5 T4), None on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))
