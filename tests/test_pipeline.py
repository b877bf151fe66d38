"""Pipeline parallelism: plans, stages cut from the one model, and every schedule against one process.

The multi-rank checks run the library's Pipeline (torch.distributed.pipelining underneath) on gloo
ranks, one optimizer step's forward and backward in fp32, and compare the loss, every gradient a rank
holds (under its global name) and the global gradient norm with the serial model's. The language model
has tied embeddings: under looped placements the first and last stage hold one copy each, whose
gradients the pipeline sums (so the copies stay equal); under V placements both are on rank 0.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from distributed.grad_norm import grad_norm
from distributed.pipeline.schedule import Pipeline, PipelineForward
from distributed.pipeline.stage_plan import block_split, bubble_fraction, resolve_plan
from distributed.pipeline.stages import cut_for_rank
from distributed.pipeline.torch_stages import build_stages
from networks.transformer import GPT, GPTConfig
from networks.vit.model import ViT, ViTConfig
from tests.helpers import run_ranks
from utils import ConfigError
from utils.cli.config import load_config
from utils.comm import Axis, init_grid
from utils.schema import SCHEDULES, ParallelConfig

EMBED, BATCH, SEQ, VOCAB, MICRO, DEPTH = 32, 8, 16, 50, 8, 8


def gpt(depth: int = 4, tie: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(embed_dim=EMBED, depth=depth, num_heads=4, max_positions=SEQ, tie_embeddings=tie), VOCAB)


def vit(depth: int) -> ViT:
    torch.manual_seed(0)
    return ViT(ViTConfig(embed_dim=EMBED, depth=depth, num_heads=4, patch_size=4), (16, 16), 2, 2)


def test_uneven_splits_give_the_first_stages_one_block_more():
    assert block_split(5, 2) == [range(0, 3), range(3, 5)]
    assert block_split(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert block_split(4, 4) == [range(i, i + 1) for i in range(4)]


def test_placements_and_bubble_formula():
    v_plan = resolve_plan("zbv", 2, 0, 0, 4)  # V: rank r holds stages r and 2p-1-r
    assert (v_plan.stages_of(0), v_plan.stages_of(1), v_plan.microbatches) == ([0, 3], [1, 2], 4)
    loop = resolve_plan("interleaved_1f1b", 2, 2, 4, 4)  # loop: stage s on rank s % p
    assert (loop.stages_of(0), loop.stages_of(1)) == ([0, 2], [1, 3])
    assert resolve_plan("1f1b", 4, 0, 8, 4).bubble() == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v*m+p-1): interleaving shrinks it
    assert "stage 3: block 4 + head" in "\n".join(resolve_plan("zbv", 2, 0, 0, 5).describe())
    assert resolve_plan("zbv", 2, 0, 3, 4).bubble() is None  # zero bubble: no closed form; any m (torch pads)
    assert resolve_plan("looped_bfs", 2, 0, 5, 4).microbatches == 5  # no rounds rule for the BFS loop


@pytest.mark.parametrize("override,setting", [
    (["parallel.pp=4", "model.depth=3"], "parallel.pp"),  # more stages than blocks
    (["parallel.pp=2", "parallel.pp_schedule=chimera"], "parallel.pp_schedule"),
    (["parallel.pp=4", "parallel.pp_microbatches=2"], "parallel.pp_microbatches"),  # 1f1b needs >= 4
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_microbatches=3"], "parallel.pp_microbatches"),
    (["parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "model.depth=8", "parallel.pp_microbatches=9"],
     "parallel.pp_microbatches"),  # rounds of pp
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=3"], "parallel.pp_stages_per_rank"),
    (["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2"], "parallel.pp_stages_per_rank"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "precision.compile=true"], "precision.compile"),
])
def test_bad_pipeline_settings_are_one_line_errors(override, setting):
    with pytest.raises(ConfigError) as err:
        load_config(override)
    assert err.value.setting == setting and "\n" not in str(err.value)


@pytest.mark.parametrize("schedule,pp,stages_per_rank", [("1f1b", 2, 0), ("zbv", 2, 0), ("interleaved_1f1b", 2, 2),
                                                         ("gpipe", 4, 0)])
@pytest.mark.parametrize("build", [lambda: gpt(5), lambda: gpt(5, tie=False), lambda: vit(5)])
def test_stage_state_dicts_partition_the_full_model(build, schedule, pp, stages_per_rank):
    """Every rank's part keeps global names; together they hold every key of the full model once."""
    full = build().state_dict()
    plan = resolve_plan(schedule, pp, stages_per_rank, 0, 5)
    parts = [cut_for_rank(build(), plan, r).state_dict() for r in range(pp)]
    keys = [set(p) for p in parts]
    assert set().union(*keys) == set(full)
    assert sum(len(k) for k in keys) == len(full)  # disjoint
    for part in parts:
        assert all(torch.equal(t, full[name]) for name, t in part.items())


def _serial_reference(x, y):
    model = gpt(DEPTH)
    logits = model(x)
    loss = model.criterion(logits, y)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["lm_head.weight"] = grads["tok_embed.weight"]  # tied: one parameter under two names
    norm = torch.cat([g.flatten() for g in grads.values()][:-1]).norm()
    return loss.detach(), logits.detach(), grads, norm


def _schedules_match_serial(rank: int, world_size: int, schedules: list[str]) -> None:
    grid = init_grid(ParallelConfig(pp=world_size))
    torch.manual_seed(1)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    loss_ref, logits_ref, grads_ref, norm_ref = _serial_reference(x, y)
    example = torch.empty(BATCH // MICRO, SEQ, dtype=torch.long, device="meta")
    for schedule in schedules:
        plan = resolve_plan(schedule, world_size, 0, MICRO, DEPTH)
        model = cut_for_rank(gpt(DEPTH), plan, grid.rank(Axis.PP))
        stages = build_stages(model, plan, axis=grid.axis(Axis.PP), example=example, length=SEQ,
                              out_dtype=torch.float32, autocast=contextlib.nullcontext)
        pipeline = Pipeline(model, stages, plan, grid)
        loss = pipeline.train_step(x, y, 1, lambda t: t)
        pipeline.sync_grads()
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6), schedule
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads_ref[name], rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")
        norm = grad_norm(model, grid=grid, skip=pipeline.duplicates)
        assert norm.item() == pytest.approx(norm_ref.item(), rel=1e-5), schedule
        assert 0 <= pipeline.bubble < 1
        with torch.no_grad():  # the forward-only pass (validation, decoding): output on the last stage's rank
            out = PipelineForward(model, [s.submod for s in stages], plan, grid)(x)
        assert (out is None) == (plan.num_stages - 1 not in plan.stages_of(grid.rank(Axis.PP))), schedule
        if out is not None:
            torch.testing.assert_close(out, logits_ref, rtol=1e-5, atol=1e-6, msg=schedule)


@pytest.mark.parametrize("world_size,schedules", [(2, list(SCHEDULES)),
                                                  (4, ["gpipe", "1f1b", "interleaved_1f1b", "zbv"])])
def test_every_schedule_matches_the_serial_loss_and_gradients(world_size, schedules, tmp_path):
    """pp=2: all seven schedules; pp=4: single-stage, looped (v=2: 8 stages, tied copies on pp ranks 0
    and 3 through their own group) and V placements (8 stages)."""
    run_ranks(_schedules_match_serial, world_size, tmp_path, schedules, timeout_s=240)
