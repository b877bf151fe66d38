"""Peak FLOP rates of known accelerators and model FLOP utilization (MFU).

MFU = achieved training FLOPs per second / the device's dense peak for the compute precision.
Training FLOPs come from a FLOP model of the transformer (`training_flops_per_sample`), not from a
profiler, so MFU compares layouts and precisions on equal terms (recomputation from activation
checkpointing is not counted as useful work).
"""

from __future__ import annotations

import torch

# Dense peak TFLOP/s per device by compute precision: NVIDIA's datasheets (A100 2021, H100 2023 rev. for SXM5,
# NVL and PCIe, H200 2024, GH200 2023), tensor-core figures halved where the sheet quotes them with sparsity.
# The three H100 parts share a name prefix and differ in clocks and SMs: SXM5 132 SMs 80 GB HBM3, NVL 132 SMs
# 94 GB HBM3 at lower clocks, PCIe 114 SMs 80 GB HBM2e (`gpu_model` tells them apart).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM4 and PCIe alike
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},  # SXM5
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},  # SXM
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},
}
H100_PCIE_SMS = 114  # the PCIe part's SM count (SXM5 and NVL: 132)
H100_NVL_MIN_GIB = 90  # the NVL part reports about 93 GiB, SXM5 and PCIe about 79.6


def gpu_model(name: str, memory_gib: float, sm_count: int) -> str | None:
    """The PEAK_TFLOPS key of a CUDA device from its properties (name, memory in GiB, SM count), None when the
    table does not hold it. The name decides where it says the part (NVL, PCIe; GH200 before H200); an H100
    whose name does not is told by its SMs (114: PCIe) and memory (over 90 GiB with 132 SMs: NVL)."""
    upper = name.upper().replace(" ", "").replace("-", "")
    for family in ("GH200", "H200", "H100", "A100"):
        if family not in upper:
            continue
        if family in ("GH200", "A100"):
            return family
        if "NVL" in upper:
            return f"{family} NVL"
        if family == "H100" and ("PCIE" in upper or sm_count == H100_PCIE_SMS):
            return "H100 PCIe"
        if family == "H100" and memory_gib > H100_NVL_MIN_GIB:
            return "H100 NVL"
        return family
    return None


def training_flops_per_sample(tokens: int, matmul_params: int, depth: int, width: int, causal: bool = False) -> float:
    """Training FLOPs (forward + backward) of one sample of `tokens` tokens: S*(6*N_mm + 12*L*D*S), with the
    attention term halved when the attention is causal.

    6 N_mm per token for the matrix multiplies of N_mm weights (2 forward, 4 backward) plus 12 L D S per
    token for the attention scores and values of L layers of width D. A causal mask leaves half of the
    score matrix to compute (the flash kernels skip the masked blocks), so a causal model counts 6 L D S
    (as FlashAttention's and torchtitan's FLOP counts do); the ViT is not causal. The ViT's S is its patch count.
    A linear that reads the data (the ViT's patch embedding) needs no input gradient and runs 4 of the 6; it is
    counted 6 like the rest. Packed documents with document attention count as causal. tests/test_flops.py checks
    the formula against torch's FLOP counter; the differences and their sizes: docs/measurements.md.
    """
    attention = 12 * depth * width * tokens * (0.5 if causal else 1.0)
    return tokens * (6 * matmul_params + attention)


def tflops_per_device(flops_per_sample: float, samples: int, seconds: float, num_devices: int) -> float:
    """Achieved training TFLOP/s of one device when `num_devices` process `samples` in `seconds`."""
    return flops_per_sample * samples / seconds / num_devices / 1e12


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_model(device: torch.device) -> str | None:
    """This device's PEAK_TFLOPS key, read from its properties (None on the CPU and for devices not in it)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return gpu_model(props.name, props.total_memory / 2**30, props.multi_processor_count)


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak of this device for `precision`, or None when the device is not in the table."""
    model = device_model(device)
    return None if model is None else PEAK_TFLOPS[model][precision]


def mfu(tflops_per_sec: float, device: torch.device, precision: str) -> float | None:
    peak = peak_tflops(device, precision)
    return tflops_per_sec / peak if peak else None


def mfu_absence(device: torch.device, precision: str) -> str | None:
    """Why perf/mfu is not logged on this device (None when it is)."""
    if peak_tflops(device, precision) is not None:
        return None
    where = ("the CPU" if device.type != "cuda" else f"'{device_name(device)}'")
    return f"perf/mfu is not logged: no {precision} peak known for {where}; perf/tflops_per_sec is logged"
