"""`-m gpu`: the parallel layers and mappings against their serial twins, FSDP2 and the pipeline, on NCCL.

Needs two GPUs or more (skipped otherwise): every rank takes its own GPU. The layers and mappings are the
doctor's checks (utils/doctor/layers.py, adjoints.py: output, input gradient and every weight gradient against
the serial layer on identical full weights, fp32 and bf16, uneven splits; each mapping pair as adjoints); FSDP2
and the 1F1B pipeline train a few steps of the small GPT through train_mp.py and must end with exit 0.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import run_entry

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs or more")]


def _rank(rank: int, world: int, init_file: str, errors) -> None:
    try:
        from utils.comm import AxisGroup
        from utils.doctor.adjoints import adjoint_checks
        from utils.doctor.layers import layer_checks

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120), device_id=device)
        axis = AxisGroup("tp", world, rank, dist.group.WORLD, list(range(world)))
        failed = [f"{c.name}: {c.detail}" for c in adjoint_checks(axis, device) + layer_checks(axis, device)
                  if c.status != "pass"]
        errors.put((rank, failed))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        errors.put((rank, [traceback.format_exc()]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_layers_and_mappings_match_their_serial_twins_on_nccl(tmp_path):
    world = min(GPUS, 4)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / "init"), errors)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(errors.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(not failed for failed in results.values()), results


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.dp_mode=fsdp"], ["parallel=pp2"]])
def test_fsdp_and_pipeline_train_on_nccl(layout, tmp_path, corpus_root):
    proc = run_entry("train_mp.py", "model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}",
                     *layout, "trainer.max_steps=4", "trainer.val_every=0", "trainer.ckpt_every=0",
                     "trainer.num_workers=0", f"run.dir={tmp_path / 'run'}", "precision=bf16", timeout=240,
                     env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 4))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launching 2 ranks on GPUs" in proc.stdout, proc.stdout[-2000:]
