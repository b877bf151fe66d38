"""The NERSC tutorial's ViT timed at a benchmark's shape: `python utils/bench/seed_step.py SEED_DIR SPEC_JSON`.

Run by `python -m utils.bench ... --seed-dir SEED_DIR` in an interpreter of its own: the tutorial's
top-level packages are called `networks`, `utils` and `distributed`, as this project's are, so the two
cannot share one. Imports nothing of this project. SEED_DIR is a checkout of NERSC/sc24-dl-tutorial.

A step is what the tutorial's train.py does on one GPU: zero_grad, forward under autocast
(`spec["precision"]`: fp32, tf32, bf16 or fp16 with its GradScaler), its relative L2 loss, backward, Adam
(betas 0.9, 0.95; fused when `spec["fused"]`, its `--enable_fused`), with `torch.compile(model)` when
`spec["compile"]`. Prints one JSON line: seconds per step over `spec["steps"]` timed steps after
`spec["warmup"]`, and the peak memory.

With `spec["tp"]` > 1 it runs as the tutorial's train_mp.py does, under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR/PORT from the launcher): its rank groups (`utils.comm.init_model_parallel_info`, tp nearest,
dp = world / tp), its model-parallel ViT, its shared-weight sync and its DDP wrapper, on gloo when the
device is the CPU (the tutorial hard-codes NCCL in `init_process_group`, so the group is made here). Every
tp rank sees the same batch of `spec["batch"]` samples per dp rank; rank 0 prints the JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from types import SimpleNamespace


def init_model_parallel(tp: int, device):
    """The tutorial's rank groups (tp nearest, dp = world / tp) on a process group of torchrun's ranks; the
    device this rank uses."""
    import torch
    import torch.distributed as dist

    from utils import comm  # the tutorial's

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    comm.init_model_parallel_info(tp=tp, dp=dist.get_world_size() // tp, cp=1, pp=1, order="tp-dp")
    return device


def wrap_model_parallel(model, device):
    """As the tutorial's train_mp.py: shared weights synced from rank 0 of each group, then its DDP wrapper."""
    from distributed.helpers import init_params_for_shared_weights
    from distributed.mappings import init_ddp_model_and_reduction_hooks

    init_params_for_shared_weights(model)
    ids = None if device.type == "cpu" else [device.index]
    return init_ddp_model_and_reduction_hooks(model, device_ids=ids, output_device=ids)


def main(seed_dir: str, spec: dict) -> dict:
    sys.path[0] = seed_dir  # the tutorial's packages, not this folder's modules
    import torch

    from networks.vit import ViT
    from utils.loss import l2_loss

    device, tp = torch.device(spec["device"]), spec.get("tp", 1)
    if tp > 1:
        device = init_model_parallel(tp, device)
    torch.manual_seed(0)
    params = SimpleNamespace(img_size=spec["img_size"], n_in_channels=spec["in_channels"],
                             n_out_channels=spec["out_channels"], patch_size=spec["patch_size"],
                             embed_dim=spec["embed_dim"], depth=spec["depth"], num_heads=spec["num_heads"], dropout=0.0)
    model = ViT(params).to(device)
    if tp > 1:
        model = wrap_model_parallel(model, device)
    if spec["compile"]:
        model = torch.compile(model)
    kernel = {"fused": True} if spec["fused"] else {}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.95), **kernel)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec["precision"] == "tf32"
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((spec["batch"], spec["in_channels"], *spec["img_size"]), generator=gen).to(device)
    y = torch.randn((spec["batch"], spec["out_channels"], *spec["img_size"]), generator=gen).to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = l2_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(spec["warmup"]):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    sync()
    seconds = (time.perf_counter() - start) / spec["steps"]
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    return {"seconds": seconds, "peak_gib": peak}


if __name__ == "__main__":
    result = main(sys.argv[1], json.loads(sys.argv[2]))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
