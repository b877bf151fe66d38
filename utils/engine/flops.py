"""Peak FLOP rates of known accelerators and model FLOP utilization (MFU).

MFU = achieved training FLOPs per second / the device's dense peak for the compute precision.
Training FLOPs come from a FLOP model of the transformer (`training_flops_per_sample`), not from a
profiler, so MFU compares layouts and precisions on equal terms (recomputation from activation
checkpointing is not counted as useful work).
"""

from __future__ import annotations

import torch

# Dense peak TFLOP/s per device by compute precision (vendor datasheets, no sparsity).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},
}


def training_flops_per_sample(tokens: int, matmul_params: int, depth: int, width: int) -> float:
    """Training FLOPs (forward + backward) of one sample of `tokens` tokens: S*(6*N_mm + 12*L*D*S).

    6 N_mm per token for the matrix multiplies of N_mm weights (2 forward, 4 backward) plus 12 L D S per
    token for the attention scores and values of L layers of width D, counted as non-causal (the usual
    convention for the language model too). The ViT's S is its patch count.
    """
    return tokens * (6 * matmul_params + 12 * depth * width * tokens)


def tflops_per_device(flops_per_sample: float, samples: int, seconds: float, num_devices: int) -> float:
    """Achieved training TFLOP/s of one device when `num_devices` process `samples` in `seconds`."""
    return flops_per_sample * samples / seconds / num_devices / 1e12


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak of this device for `precision`, or None when the device is not in the table."""
    if device.type != "cuda":
        return None
    name = device_name(device).upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # GH200 before H200
        if key in name.replace(" ", ""):
            if key == "H100" and "PCIE" in name:
                return None  # PCIe parts have lower clocks; no guessed peak
            return PEAK_TFLOPS[key][precision]
    return None


def mfu(tflops_per_sec: float, device: torch.device, precision: str) -> float | None:
    peak = peak_tflops(device, precision)
    return tflops_per_sec / peak if peak else None


def mfu_absence(device: torch.device, precision: str) -> str | None:
    """Why perf/mfu is not logged on this device (None when it is)."""
    if peak_tflops(device, precision) is not None:
        return None
    known = ", ".join(PEAK_TFLOPS)
    where = ("the CPU" if device.type != "cuda" else f"'{device_name(device)}'")
    return (f"perf/mfu is not logged: it divides perf/tflops_per_sec by the device's dense peak for {precision}, "
            f"and utils/engine/flops.py knows the peak of {known} (SXM parts) only, not of {where}; "
            "perf/tflops_per_sec (the model's FLOPs per second per device) is logged")
