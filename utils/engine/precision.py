"""Numerical precision (`precision=`, utils/schema.py `PrecisionConfig`): autocast, TF32 switches, grad scaler."""

from __future__ import annotations

import contextlib

import torch

from distributed.collectives import all_reduce_
from utils.comm import AxisGroup


def autocast_dtype(mode: str) -> torch.dtype | None:
    """The autocast dtype of a mode (None: no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


def cpu_has_bf16_kernels() -> bool:
    """Whether torch's bf16 matmuls on this CPU run on oneDNN (from AVX-512 on); without it (AVX2 only) they run
    on a reference loop many times slower than fp32's (docs/measurements.md)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def precision_notice(mode: str, device: torch.device) -> str | None:
    """One line when `mode` is slow or has no effect on `device` (None when it is fine): fp16 on CPU has no
    fast kernels (a step many times slower than fp32's: docs/measurements.md), nor has bf16 on a CPU without
    AVX-512, bf16 on a GPU without bf16 support is emulated, tf32 on CPU is plain fp32."""
    if device.type == "cpu" and mode == "fp16":
        return ("precision=fp16 is very slow on CPU (no fp16 matrix kernels; steps can take 10x longer): "
                f"use {'precision=bf16 or ' if cpu_has_bf16_kernels() else ''}precision=fp32")
    if device.type == "cpu" and mode == "bf16" and not cpu_has_bf16_kernels():
        return ("precision=bf16 is slow on this CPU (no bf16 matrix kernels without AVX-512; matmuls can take 10x "
                "longer): use precision=fp32")
    if device.type == "cuda" and mode == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "precision=bf16 is emulated on this GPU (no bf16 units): use precision=fp16 (loss scaling) or fp32"
    if device.type == "cpu" and mode == "tf32":
        return "precision=tf32 has no effect on CPU (TF32 is a GPU matmul mode): it trains as fp32"
    return None


def configure_matmul(mode: str) -> None:
    """Switch TF32 through torch's settings: on for tf32 (and for AMP's fp32 leftovers), off for fp32."""
    allow = mode != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    torch.set_float32_matmul_precision("high" if allow else "highest")


def autocast(mode: str, device: torch.device):
    """Autocast context for the forward pass of a mode (a null context for fp32/tf32)."""
    dtype = autocast_dtype(mode)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class GridGradScaler(torch.amp.GradScaler):
    """A loss scaler whose inf/NaN verdict every rank of `axis` agrees on.

    Under tensor (or pipeline) parallelism each rank unscales different gradient shards, so one rank
    can find an inf that another does not; stepping on some ranks and skipping on others would split
    the replicas for good. After the local unscale, the found-inf flags are max-reduced over `axis`,
    every rank of the job (as Megatron does over its model-parallel group), so a skipped step is
    skipped everywhere and every rank's scale evolves identically.
    """

    def __init__(self, device: str, *, axis: AxisGroup, **kwargs):
        super().__init__(device, **kwargs)
        self.axis = axis

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled() or self.axis.size == 1:
            return
        flags = list(self._found_inf_per_device(optimizer).values())  # torch keeps them per device
        verdict = torch.stack(flags).amax() if flags else torch.zeros((), device=self._scale.device)
        all_reduce_(verdict, self.axis, "max")
        for flag in flags:
            flag.copy_(verdict)


def grad_scaler(mode: str, device: torch.device, axis: AxisGroup) -> GridGradScaler:
    """A loss scaler over the ranks of `axis`, enabled for fp16 only (bf16 has fp32's range)."""
    return GridGradScaler(device.type, axis=axis, enabled=mode == "fp16")
