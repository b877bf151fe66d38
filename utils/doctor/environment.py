"""The doctor's first look: software versions, the devices every rank got, the links between them, the known peak.

Device-specific lines are the few calls under `if device.type == "cuda"` (names, memory, NCCL's version, bf16
support) and `nvidia-smi topo -m`; on the CPU the same checks run and say what they cannot know.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import zlib

import torch

from distributed.collectives import all_gather
from distributed.device import gpu_identity
from utils.comm import Grid
from utils.doctor.report import Check, verdict
from utils.engine.flops import PEAK_TFLOPS, device_name, peak_tflops


def versions(device: torch.device) -> dict[str, str]:
    """torch, CUDA and NCCL versions (CUDA and NCCL 'none' on a CPU build or device)."""
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
             "nccl": "none"}
    if device.type == "cuda":
        facts["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return facts


def device_facts(device: torch.device) -> dict:
    """This rank's device: name, logical index, identity (UUID or PCI bus id, distributed/device.py) and memory
    in GiB (None on the CPU)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "index": device.index, "identity": gpu_identity(device),
                "memory_gib": round(props.total_memory / 2**30, 1), "visible": torch.cuda.device_count()}
    return {"name": device_name(device), "index": -1, "identity": "cpu", "memory_gib": None, "visible": 0}


def shared_gpus(placement: list[tuple[int, int]]) -> int:
    """Ranks whose (node, GPU identity) another rank holds too (0 on a correct launch)."""
    return len(placement) - len(set(placement))


def node_of_every_rank(grid: Grid) -> list[tuple[int, int]]:
    """(node id, GPU id) of every global rank: checksums of the host name and of the GPU's identity (its UUID or
    PCI bus id, not its logical index: under per-task binding every rank's GPU is cuda:0)."""
    facts = device_facts(grid.device)
    mine = torch.tensor([[zlib.crc32(socket.gethostname().encode()), zlib.crc32(facts["identity"].encode())]],
                        dtype=torch.int64, device=grid.device)
    if grid.world_size == 1:
        return [tuple(mine[0].tolist())]
    every = all_gather(mine, grid.world, 0, [1] * grid.world_size)
    return [tuple(row) for row in every.cpu().tolist()]


def links() -> str:
    """`nvidia-smi topo -m` (the links between the node's GPUs), or why it is unknown."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi on this node)"
    proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 else f"unknown (nvidia-smi topo -m: {proc.stderr.strip()[:200]})"


def environment_checks(grid: Grid, precision: str) -> tuple[list[Check], dict]:
    """The environment's checks and facts (rank 0's, plus every rank's node and device)."""
    device = grid.device
    facts = {**versions(device), "device": device_facts(device), "backend": "nccl" if device.type == "cuda" else
             "gloo" if grid.world_size > 1 else "none", "world": grid.world_size, "layout": grid.signature}
    placement = node_of_every_rank(grid)
    facts["nodes"] = len({node for node, _ in placement})
    facts["links"] = links() if grid.is_main else ""
    peak = peak_tflops(device, precision)
    facts["peak_tflops"] = peak
    checks = [Check("environment", "versions", "pass", f"torch {facts['torch']}, CUDA {facts['cuda']}, "
                    f"NCCL {facts['nccl']}, Python {facts['python']}", versions(device))]
    on_gpu = device.type == "cuda"
    dev = facts["device"]
    checks.append(Check("environment", "device", "pass" if on_gpu else "warn",
                        f"{dev['name']}, {dev['memory_gib']} GiB, {dev['visible']} visible on rank 0's node" if on_gpu
                        else "no GPU: the checks run on the CPU with gloo", dev))
    shared = shared_gpus(placement)
    checks.append(Check("environment", "one device per rank", verdict(not on_gpu or shared == 0),
                        f"{grid.world_size} ranks on {facts['nodes']} node(s)"
                        + (f", {shared} rank(s) share a GPU with another" if on_gpu and shared else ""),
                        {"placement": placement}))
    checks.append(Check("environment", "links", "pass" if not facts["links"].startswith("unknown") else "warn",
                        facts["links"].splitlines()[0] if facts["links"] else "", {"topology": facts["links"]}))
    checks.append(Check("environment", f"peak {precision} TFLOP/s", "pass" if peak else "warn",
                        f"{peak} TFLOP/s dense" if peak else f"not in utils/engine/flops.py ({', '.join(PEAK_TFLOPS)}):"
                        " no MFU", {"peak_tflops": peak}))
    if on_gpu and precision == "bf16":
        ok = torch.cuda.is_bf16_supported()
        checks.append(Check("environment", "bf16 support", verdict(ok), "" if ok else "this GPU has no bf16: "
                            "use precision=fp16"))
    return checks, facts
