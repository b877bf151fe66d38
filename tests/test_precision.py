"""Precision modes, loss scaling, gradient accumulation and activation checkpointing, through the real
build path (utils.engine.build.build_run, as train.py) in-process, for the ViT and the language model."""

import json
import math

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tests.helpers import NARROW, run_ranks
from utils.cli.config import load_config
from utils.cli.runs import run_digest
from utils.comm import init_grid
from utils.engine.build import build_run
from utils.engine.precision import GridGradScaler
from utils.schema import ParallelConfig


def make_trainer(run_dir, *overrides):
    cfg, choices, yaml = load_config([f"run.dir={run_dir}", "trainer.num_workers=0", *overrides])
    return build_run(cfg, choices, yaml, run_digest(cfg, choices, yaml))


def train_losses(trainer, steps):
    batches = iter(trainer.loaders.train)
    return [trainer.train_step(*next(batches))[0].item() for _ in range(steps)]


@pytest.fixture
def workloads(era5_root, corpus_root):
    return {"vit": ["trainer.global_batch_size=8", f"data.root={era5_root}"],
            "gpt": ["model=gpt_tiny", "data=wikitext_sample", f"data.root={corpus_root}", "data.seq_len=32",
                    "trainer.global_batch_size=8", "optim.lr=2e-3"]}


@pytest.mark.parametrize("workload", ["vit", "gpt"])
@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("tf32", torch.float32),
                                        ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_every_precision_trains(workload, mode, dtype, workloads, tmp_path):
    small = ["data.img_size=[16,32]"] if workload == "vit" else []  # fp16 matmuls are slow on the CPU
    if mode in ("bf16", "fp16"):  # and so are bf16 ones without AVX-512: a tenth of fp32's speed
        small += NARROW
    trainer = make_trainer(tmp_path, f"precision={mode}", *workloads[workload], *small)
    with trainer.autocast():
        fc1 = trainer.raw_model.blocks[0].mlp.fc1
        assert fc1(torch.randn(2, fc1.in_features)).dtype == dtype
    assert trainer.scaler.is_enabled() == (mode == "fp16")
    assert torch.backends.cuda.matmul.allow_tf32 == (mode != "fp32")
    losses = train_losses(trainer, 6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    if mode == "fp16":
        saved = trainer.save_checkpoint()  # the scaler's state goes into checkpoints
        assert json.loads((saved / "state.json").read_text())["scaler"]["scale"] > 0


def test_gradient_accumulation_follows_the_unaccumulated_curve(workloads, tmp_path):
    plain = train_losses(make_trainer(tmp_path / "a", *workloads["vit"]), 5)
    accumulated = train_losses(make_trainer(tmp_path / "b", *workloads["vit"], "trainer.grad_accum_steps=4"), 5)
    assert accumulated == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("workload", ["vit", "gpt"])
def test_activation_checkpointing_changes_nothing(workload, workloads, tmp_path):
    plain = train_losses(make_trainer(tmp_path / "a", *workloads[workload]), 4)
    checkpointed = train_losses(make_trainer(tmp_path / "b", *workloads[workload],
                                             "trainer.activation_checkpointing=true"), 4)
    assert checkpointed == pytest.approx(plain, rel=1e-6)


def _scaler_rank(rank, world_size):
    """Rank 1 alone sees an inf gradient: both ranks must skip the step and back off the scale."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    world = init_grid(ParallelConfig()).world  # dp=2: every rank
    scaler = GridGradScaler("cpu", axis=world, init_scale=1024.0)
    scaler.scale((weight * (float("inf") if rank == 1 else 1.0)).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(3)), "the step must be skipped on every rank"
    assert scaler.get_scale() == 512.0


def test_fp16_inf_verdict_agrees_across_ranks(tmp_path):
    run_ranks(_scaler_rank, 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("workload,checkpointed", [("vit", True), ("gpt", False)])
def test_compiled_training_follows_eager(workload, checkpointed, workloads, tmp_path):
    """precision.compile=true (each block compiled, inductor on CPU) trains like eager, the ViT's blocks also
    checkpointed (checkpoint inside compile, utils.engine.build's wrap_blocks): the wrapper keeps the state
    dict's names (checkpoints load either way), and the two blocks share one graph, checkpoint included."""
    small = [*workloads[workload], "model.depth=2"]
    eager = make_trainer(tmp_path / "eager", *small)
    torch._dynamo.reset()
    counters.clear()
    compiled = make_trainer(tmp_path / "compiled", *small, "precision.compile=true",
                            f"trainer.activation_checkpointing={str(checkpointed).lower()}")
    blocks = list(compiled.raw_model.blocks)
    assert all(isinstance(b, CheckpointWrapper) == checkpointed for b in blocks) and len(blocks) == 2
    assert list(compiled.raw_model.state_dict()) == list(eager.raw_model.state_dict())
    assert train_losses(compiled, 3) == pytest.approx(train_losses(eager, 3), rel=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # both blocks, three steps: one graph


def test_slow_or_idle_precision_is_announced_in_one_line(monkeypatch):
    from utils.engine import precision
    from utils.engine.precision import precision_notice

    cpu = torch.device("cpu")
    assert "no effect on CPU" in precision_notice("tf32", cpu)
    assert precision_notice("fp32", cpu) is None
    assert (precision_notice("bf16", cpu) is None) == precision.cpu_has_bf16_kernels()
    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: True)  # AVX-512: oneDNN's bf16 kernels
    assert precision_notice("bf16", cpu) is None
    assert "use precision=bf16 or precision=fp32" in precision_notice("fp16", cpu)
    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: False)  # AVX2 only: torch's reference loop
    assert "use precision=fp32" in precision_notice("bf16", cpu)
    assert "bf16" not in precision_notice("fp16", cpu).split("use ")[-1]  # not advised where it is slow too
    assert all("\n" not in precision_notice(m, cpu) for m in ("fp16", "tf32", "bf16"))
