"""Layout invariance through the real entry points: every layout follows the single-process loss curve.

fp32 on CPU with dropout 0: the per-step training loss and gradient norm of dp, tp, cp (ring and
all-gather attention, uneven patches), pp (every kind of schedule: GPipe, 1F1B, interleaved, the V-shaped
zero bubble; tied embeddings across stages) and their products match the one-process run within relative
1e-4 for 6 steps, for the ViT and for the language model. Runs go
through train.main on the ranks of the test pool (tests/rank_pool.py), as under torchrun, and once
through torchrun itself; train_mp.py's start of the ranks is tested in tests/test_launch.py.
"""

import math
import re
import shutil
import subprocess
import sys

import pytest

from distributed.collectives import ring_bytes
from tests.helpers import NARROW, QUIET, ROOT, TINY_GPT, read_scalars, read_tags
from tests.rank_pool import run_entry_ranks
from tests.test_plan import report_of
from utils.checkpoints.sharded_state import read_shapes
from utils.cli.config import load_config
from utils.plan.cost_model import plan_layout
from utils.plan.options import GPUS
from utils.tasks import build_task

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

STEPS = 6  # long enough to stop at STOP, resume and still train; the matrix (3 steps) covers the pairs
STOP = 3  # the step the resume tests stop at (their checkpoint), three steps before the end
LOW_PRECISION_REL = {"bf16": 8 * 2.0**-8}  # 8 unit roundoffs: a sense check; the matrix derives its bounds
# one validation, at the end; sequence parallelism on under tp (the GPU default; the CPU default, off, is
# test_vit_tp2_without_sequence_parallelism)
COMMON = [*QUIET, f"trainer.max_steps={STEPS}", "trainer.log_every=5", "parallel.sequence_parallel=true"]
VIT = ["trainer.global_batch_size=8", "data.limit_nsamples_val=8"]
# no greedy decoding at validation but under pp2tp2 (below)
GPT = [*TINY_GPT, "data.limit_eval_tokens=1024", "trainer.global_batch_size=8", *NARROW]

LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "tp2": ["parallel=tp2"],
    "tp4": ["parallel=tp4"],  # Llama: 2 key/value heads over 4 ranks, each keeping its queries' group
    "tp2dp2": ["parallel=tp2", "parallel.dp=2"],
    "dp2_accum2": ["parallel.dp=2", "trainer.grad_accum_steps=2"],  # no dp sync before the last micro-batch
    "fsdp_dp2": ["parallel.dp=2", "parallel.dp_mode=fsdp"],  # FSDP2 from the first step (more under resumes below)
    "fsdp_tp2dp2": ["parallel=tp2", "parallel.dp=2", "parallel.dp_mode=fsdp"],
    "cp3": ["parallel.cp=3"],  # ViT: 128 patches split 43/43/42; LM: 2 x 3 chunks of 32 tokens do not fit
    "cp2": ["parallel=cp2"],
    "cp2_alltoall": ["parallel=cp2", "parallel.cp_attention=alltoall"],
    "cp4_alltoall": ["parallel.cp=4", "parallel.cp_attention=alltoall"],
    "cp4_hierarchical": ["parallel.cp=4", "parallel.cp_attention=hierarchical", "parallel.cp_a2a=2"],
    "tp2cp2_allgather": ["parallel=tp2cp2", "parallel.cp_attention=allgather"],
    "cp2dp2": ["parallel=cp2", "parallel.dp=2"],  # gradients summed over cp, averaged over dp, in one reduction
    "cp2_accum2_ckpt": ["parallel=cp2", "trainer.grad_accum_steps=2", "trainer.activation_checkpointing=true"],
    "pp2_gpipe": ["parallel=pp2", "parallel.pp_schedule=gpipe"],
    "pp2_1f1b": ["parallel=pp2", "parallel.pp_schedule=1f1b"],
    "pp2_interleaved": ["parallel=pp2", "parallel.pp_schedule=interleaved_1f1b"],  # 4 stages of one block
    "pp2tp2": ["parallel=pp2", "parallel.tp=2", "data.sample_tokens=8"],  # decoding through stages and shards
    "pp2cp2": ["parallel=pp2", "parallel.cp=2"],
}
# A layout's group structure under each order is tested in tests/test_grid.py; here, one 4-rank
# product per pair of axes and model is enough to keep the suite within its time. The ViT under tp2
# runs through torchrun (test_torchrun_launch), tp2 x dp2 stopped and resumed (test_vit_tp2dp2_*).
# Pipeline schedules: every one against the serial gradients in tests/test_pipeline.py; here GPipe, 1F1B,
# interleaved 1F1B, ZBV x dp2 (with a resume, below), and 1F1B with the LM's tied embedding under tp and cp.
VIT_LAYOUTS = ["dp2", "dp2_accum2", "fsdp_dp2", "fsdp_tp2dp2", "cp3", "tp2cp2_allgather", "cp2dp2", "pp2_gpipe",
               "pp2_1f1b", "pp2_interleaved", "cp4_alltoall"]  # hierarchical: the GPT's and tests/test_cp_variants.py
GPT_LAYOUTS = ["dp2", "tp2", "cp2", "cp2_alltoall", "cp4_hierarchical", "tp2cp2_allgather", "cp2_accum2_ckpt", "pp2tp2",
               "pp2cp2"]
# Llama (RMSNorm, SwiGLU, rotary, 4 query heads over 2 key/value heads, untied head): key/value heads kept whole
# per group (tp4), grouped K/V around the ring (cp2), repeated for the all-to-all (cp4), stages, FSDP (split
# over tp2 and gathered under tp2 x cp2: the matrix's Llama cases).
LLAMA = ["model=llama_tiny", *TINY_GPT[1:], "data.limit_eval_tokens=1024", "trainer.global_batch_size=8"]
LLAMA_LAYOUTS = ["tp4", "cp2", "cp4_alltoall", "pp2tp2", "fsdp_dp2"]  # tp2, tp2 x cp2: in the matrix


def curves(run_dir):
    """(train/loss, train/grad_norm) per step (the norm checks the sharded-gradient reduction too), and
    the final val/loss (validation's forward and its reduction) and, for the language model, val/bpb (its
    byte counts reduced like the loss)."""
    scalars = read_scalars(run_dir)
    tags = ["train/loss", "train/grad_norm", "val/loss"] + (["val/bpb"] if "val/bpb" in scalars else [])
    return tuple([v for _, v in scalars[tag]] for tag in tags)


def run_layout(tmp_path, name, workload, *args):
    """A run of the layout's ranks on the test pool (train.main as under torchrun; train_mp.py's own
    start of those ranks is tested in tests/test_launch.py): its run directory."""
    run_dir = tmp_path / name
    results = run_entry_ranks([*workload, *COMMON, f"run.dir={run_dir}", *args])
    assert [r.value for r in results] == [0] * len(results), \
        next(r.error or r.stdout[-2000:] + r.stderr[-4000:] for r in results if r.value != 0)
    return run_dir


def assert_same_curve(reference, other):
    assert len(reference) == len(other)
    for ref, got in zip(reference, other):
        assert len(ref) == len(got) and len(ref) in (1, STEPS)
        assert got == pytest.approx(ref, rel=1e-4)


@pytest.fixture(scope="module")
def vit_reference(tmp_path_factory, era5_root):
    tmp = tmp_path_factory.mktemp("vit")
    return curves(run_layout(tmp, "single", VIT, f"data.root={era5_root}")), tmp


def dp2_bytes_per_step(*overrides: str) -> int:
    """What a dp=2 rank sends per step: the ring all-reduce of every fp32 gradient once (none for the
    micro-batches before the last), of the fp32 loss for the logged mean, and of the step's three fp32
    values agreed by every rank (non-finite values, stop signal, peak host memory; dp is the whole world here)."""
    cfg, _, _ = load_config([*VIT, *overrides])
    params = sum(p.numel() for p in build_task(cfg, load_data=False).build_model().parameters())
    return ring_bytes("all_reduce", 4 * params, 2) + ring_bytes("all_reduce", 4, 2) + ring_bytes("all_reduce", 12, 2)


def assert_planned(run_dir, overrides: list[str], world: int) -> None:
    """The planner (utils/plan/cost_model.py: the real trainer on a fake group, one shapes-only step) predicts the run's
    logged comm/<axis>_bytes of every axis and the bytes its rank 0 reports holding, exactly."""
    plan = plan_layout(overrides, GPUS["cpu"], world, rank=0)
    logged = {tag[len("comm/"):-len("_bytes")]: values[0][1] for tag, values in read_scalars(run_dir).items()
              if tag.startswith("comm/")}
    assert plan.comm_bytes == logged
    assert report_of(plan) == re.search(r"this rank holds .*", (run_dir / "train.log").read_text()).group(0)


@pytest.mark.parametrize("layout", VIT_LAYOUTS)
def test_vit_layouts_follow_the_single_process_curve(layout, vit_reference, era5_root):
    reference, tmp = vit_reference
    run_dir = run_layout(tmp, layout, VIT, f"data.root={era5_root}", *LAYOUTS[layout])
    assert_same_curve(reference, curves(run_dir))
    scalars = read_scalars(run_dir)
    if layout.startswith("dp2"):  # complete and exact: a dp all-reduce per micro-batch would double it
        want = dp2_bytes_per_step(f"data.root={era5_root}")
        assert [v for _, v in scalars["comm/dp_bytes"]] == [want] * STEPS
    if layout in ("dp2", "cp2dp2", "pp2_gpipe"):
        assert_planned(run_dir, [*VIT, f"data.root={era5_root}", *LAYOUTS[layout]], 4 if layout == "cp2dp2" else 2)
    for axis in ("tp", "cp"):
        if axis in layout:
            assert scalars[f"comm/{axis}_bytes"][0][1] > 0
    if layout == "pp2_gpipe":  # exact: rank 0 sends m microbatches' activations (B/m x N x D fp32), then
        # the loss and bubble (2 floats), the grad norm's sum of squares and the three agreed values over pp
        cfg, _, _ = load_config([*VIT, f"data.root={era5_root}"])
        activations = 8 * 128 * cfg.model.embed_dim * 4  # global batch x 128 patches x D, in 2 microbatches
        assert [v for _, v in scalars["comm/pp_bytes"]] == [activations + 8 + 4 + 12] * STEPS
        bubble = [v for _, v in scalars["perf/pp_bubble"]]
        assert all(0 < b < 1 for b in bubble) and scalars["perf/pp_bubble_formula"][0][1] == pytest.approx(1 / 3)


def test_vit_pp2_zbv_dp2_resumes_stage_and_replica_checkpoints(vit_reference, era5_root):
    """pp2 x dp2 under the V schedule (rank 0 of each pipeline holds the first and last stage; one dp
    reduction after the last microbatch) stops at step STOP: the checkpoint holds every tensor of the
    single-process model once, under its global name, written by the stages' ranks; the resumed run
    restores every rank's RNG and follows the uninterrupted curve."""
    reference, tmp = vit_reference
    args = [f"data.root={era5_root}", "parallel=pp2", "parallel.pp_schedule=zbv", "parallel.dp=2",
            "trainer.ckpt_every=0"]
    run_dir = run_layout(tmp, "pp2_zbv_dp2", VIT, *args, f"trainer.stop_at_step={STOP}")
    saved = read_shapes(run_dir / "checkpoints" / f"step_{STOP:07d}")
    assert {k for k in saved if k.startswith("model/")} == {f"model/{k}" for k in serial_shapes(VIT, era5_root)}
    assert {k.split("/")[1] for k in saved if k.startswith("rng/")} == {"0", "1", "2", "3"}
    run_layout(tmp, "pp2_zbv_dp2", VIT, *args)
    assert_same_curve(reference, curves(run_dir))


def serial_shapes(workload, root) -> dict[str, tuple[int, ...]]:
    cfg, _, _ = load_config([*workload, f"data.root={root}"])
    return {k: tuple(v.shape) for k, v in build_task(cfg).build_model().state_dict().items()}


def resume_under(tmp, source, name, workload, *args, same_grid=False) -> tuple[list[float], list[float], list[float]]:
    """The curves (the steps after STOP, the final validation) of a run resumed from `source`'s checkpoint of
    step STOP. `same_grid`: the same ranks per axis (another dp mode), so every rank's RNG state is restored."""
    stopped = source / "checkpoints" / f"step_{STOP:07d}"
    run_dir = run_layout(tmp, name, workload, f"trainer.resume={stopped}", *args)
    log = (run_dir / "train.log").read_text()
    assert (f"random streams re-derived from (seed, step {STOP}, rank)" in log) != same_grid
    return curves(run_dir)


def assert_follows_from_the_stop(reference, resumed):
    """The resumed run's steps after STOP and its final validation (val/loss, and val/bpb for a language model)."""
    loss, norm, *final = resumed
    assert len(loss) == len(norm) == STEPS - STOP and len(final) == len(reference) - 2
    assert loss == pytest.approx(reference[0][STOP:], rel=1e-5)
    assert norm == pytest.approx(reference[1][STOP:], rel=1e-5)
    for got, want in zip(final, reference[2:]):
        assert len(got) == 1 and got == pytest.approx(want, rel=1e-5)


TP2DP2 = ["parallel=tp2", "parallel.dp=2", "parallel.sequence_parallel=null"]


@pytest.fixture(scope="module")
def vit_tp2dp2_stopped(vit_reference, era5_root):
    """tp2 x dp2 stopped at step STOP of STEPS (its checkpoint: tp shards as DTensors, written once per replica)."""
    _, tmp = vit_reference
    # the CPU default (sequence parallelism off), which the planner predicts for gpu=cpu
    return run_layout(tmp, "tp2dp2_stopped", VIT, f"data.root={era5_root}", *TP2DP2, f"trainer.stop_at_step={STOP}")


def test_planner_predicts_the_tp2dp2_run(vit_tp2dp2_stopped, era5_root):
    assert_planned(vit_tp2dp2_stopped, [*VIT, f"data.root={era5_root}", "parallel=tp2", "parallel.dp=2"], 4)


def test_checkpoint_holds_the_single_process_shapes(vit_tp2dp2_stopped, era5_root):
    """The regression test for DCP's silent loss of plain tensor shards: every model tensor (and Adam
    moment) of a tp2 x dp2 checkpoint has its single-process global shape."""
    saved = read_shapes(vit_tp2dp2_stopped / "checkpoints" / f"step_{STOP:07d}")
    serial = serial_shapes(VIT, era5_root)
    assert {k: v for k, v in saved.items() if k.startswith("model/")} == {f"model/{k}": v for k, v in serial.items()}
    params = {k for k in serial if "weight" in k or "bias" in k or k == "pos_embed"}
    for name in params:
        assert saved[f"optim/{name}/exp_avg"] == saved[f"optim/{name}/exp_avg_sq"] == serial[name], name


FSDP = "parallel.dp_mode=fsdp"
RESUMED_UNDER = {"tp4": ["parallel=tp4"], "single": ["parallel=single"], "pp2": ["parallel=pp2"],
                 "fsdp_dp2": ["parallel.dp=2", FSDP],
                 "fsdp_tp2dp2": ["parallel=tp2", "parallel.dp=2", FSDP, "parallel.fsdp_reshard_after_forward=false"],
                 "fsdp_cp2dp2": ["parallel=cp2", "parallel.dp=2", FSDP],
                 "fsdp_pp2dp2": ["parallel=pp2", "parallel.dp=2", FSDP, "parallel.fsdp_reshard_after_forward=false"]}


@pytest.mark.parametrize("layout", ["tp2dp2", *RESUMED_UNDER])
def test_vit_tp2dp2_checkpoint_resumes_under_any_layout(layout, vit_tp2dp2_stopped, vit_reference, era5_root):
    """The steps after resuming the tp2 x dp2 (DDP) checkpoint of step STOP under the same layout (in its own
    run directory, every rank's RNG restored), tp4, one process, pp2, and FSDP2 over dp, dp x tp, dp x cp
    and dp x pp (blocks sharded, the stages' ends replicated) follow the uninterrupted single-process curve
    (loss and gradient norm) within 1e-5. The FSDP runs' own final checkpoints hold the single-process shapes."""
    reference, tmp = vit_reference
    if layout == "tp2dp2":
        run_layout(tmp, "tp2dp2_stopped", VIT, f"data.root={era5_root}", *TP2DP2)
        loss, norm, val = curves(vit_tp2dp2_stopped)
        assert_follows_from_the_stop(reference, (loss[STOP:], norm[STOP:], val))
        return
    resumed = resume_under(tmp, vit_tp2dp2_stopped, f"from_tp2dp2_{layout}", VIT, f"data.root={era5_root}",
                           *RESUMED_UNDER[layout], same_grid=layout == "fsdp_tp2dp2")
    assert_follows_from_the_stop(reference, resumed)
    if layout.startswith("fsdp"):  # written after the last validation (with reshard_after_forward false too)
        saved = read_shapes(tmp / f"from_tp2dp2_{layout}" / "checkpoints" / f"step_{STEPS:07d}")
        assert {k: v for k, v in saved.items() if not k.startswith("rng/")} == \
            {k: v for k, v in read_shapes(vit_tp2dp2_stopped / "checkpoints" / f"step_{STOP:07d}").items()
             if not k.startswith("rng/")}
        assert {k: v for k, v in saved.items() if k.startswith("model/")} == \
            {f"model/{k}": v for k, v in serial_shapes(VIT, era5_root).items()}


def test_vit_tp2_without_sequence_parallelism(vit_reference, era5_root):
    """The CPU default: parallel.sequence_parallel unset (null) is off on gloo."""
    reference, tmp = vit_reference
    run_dir = run_layout(tmp, "tp2_nosp", VIT, f"data.root={era5_root}", "parallel=tp2",
                         "parallel.sequence_parallel=null")
    assert_same_curve(reference, curves(run_dir))


def test_the_matrix_runs_the_vits_bf16_ring_and_fp16_pipeline():
    """bf16 under cp's ring and fp16's loss scaler under pp are left to the matrix's ViT cases (bounds derived from
    the spread of correct layouts, far below 8 unit roundoffs): the covering set must hold them."""
    from tests.matrix import covering_set

    accepted, _ = covering_set()
    vit = [c for c in accepted if c.model == "vit"]
    assert any(c.precision == "bf16" and c.cp > 1 and c.cp_attention == "ring" for c in vit)
    assert any(c.precision == "fp16" and c.pp > 1 for c in vit)


@pytest.mark.parametrize("mode,layout", [("bf16", ["parallel.dp=2", "parallel.dp_mode=fsdp"])])
def test_mixed_precision_under_model_parallelism(mode, layout, era5_root, tmp_path):
    """bf16 under FSDP2 over dp=2, 6 steps: every logged loss, gradient norm and validation loss finite (no inf,
    no NaN), the loss falling, and the whole curve within 8 unit roundoffs of the one-process run of the same
    precision. A batch of 3 per rank: validation's 31 samples make 6 batches on rank 0 and 5 on rank 1, so rank 1
    runs a padding forward (every FSDP forward gathers over dp: unequal counts would hang)."""
    name = "_".join([mode, *(o.split("=")[1] for o in layout)])
    batch = ["trainer.global_batch_size=6"] if "parallel.dp_mode=fsdp" in layout else VIT
    run_dir = run_layout(tmp_path, name, batch, f"data.root={era5_root}", *layout, f"precision={mode}",
                         *NARROW)
    single = run_layout(tmp_path, f"{name}_single", batch, f"data.root={era5_root}", f"precision={mode}", *NARROW)
    got, want = curves(run_dir), curves(single)
    assert all(math.isfinite(v) for values in got for v in values) and got[0][-1] < got[0][0]
    for values, reference in zip(got, want):
        assert len(values) == len(reference) and len(values) in (1, STEPS)
        assert values == pytest.approx(reference, rel=LOW_PRECISION_REL[mode])


def test_torchrun_launch(vit_reference, era5_root):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    reference, tmp = vit_reference
    run_dir = tmp / "torchrun"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train.py"), *VIT, *COMMON, f"data.root={era5_root}", f"run.dir={run_dir}",
                           "parallel=tp2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_curve(reference, curves(run_dir))
    assert read_scalars(run_dir)["comm/tp_bytes"][0][1] > 0


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory, corpus_root):
    tmp = tmp_path_factory.mktemp("gpt")
    return curves(run_layout(tmp, "single", GPT, f"data.root={corpus_root}")), tmp


@pytest.mark.parametrize("layout", GPT_LAYOUTS)
def test_gpt_layouts_follow_the_single_process_curve(layout, gpt_reference, corpus_root):
    reference, tmp = gpt_reference
    run_dir = run_layout(tmp, layout, GPT, f"data.root={corpus_root}", *LAYOUTS[layout])
    assert_same_curve(reference, curves(run_dir))
    assert ("val/samples/text_summary" in read_tags(run_dir)["tensors"]) == (layout == "pp2tp2")
    if layout in ("cp2", "cp2_alltoall"):
        want = cp2_step_bytes(GPT, corpus_root, LAYOUTS[layout])
        assert [v for _, v in read_scalars(run_dir)["comm/cp_bytes"]] == [want] * STEPS


def cp2_step_bytes(workload: list[str], root, layout: list[str]) -> int:
    """What a cp=2 rank sends per step, exactly: the ring's K/V blocks (forward (cp-1) x 2, backward (4cp-2))
    or the all-to-alls of q, k, v and the output there and back ((cp-1)/cp of each), per layer; the gradient
    all-reduce, the loss mean and the three agreed values (flags, host memory). K/V hold the model's
    key/value heads (grouped ones travel grouped, not copied per query head)."""
    cfg, _, _ = load_config([*workload, f"data.root={root}", *layout])
    model, cp = cfg.model, 2
    params = sum(p.numel() for p in build_task(cfg).build_model().parameters())
    tokens = 8 * (cfg.data.seq_len // cp) * 4  # batch x a rank's tokens x fp32 bytes
    q, kv = tokens * model.embed_dim, tokens * model.kv_heads * (model.embed_dim // model.num_heads)
    if cfg.parallel.cp_attention == "ring":
        attention = (2 * (cp - 1) + (4 * cp - 2)) * kv
    else:
        attention = 2 * (cp - 1) * (2 * q + 2 * kv) // cp
    return model.depth * attention + ring_bytes("all_reduce", 4 * params, 2) + 4 + 12


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, corpus_root):
    tmp = tmp_path_factory.mktemp("llama")
    return curves(run_layout(tmp, "single", LLAMA, f"data.root={corpus_root}")), tmp


@pytest.mark.parametrize("layout", LLAMA_LAYOUTS)
def test_llama_layouts_follow_the_single_process_curve(layout, llama_reference, corpus_root):
    reference, tmp = llama_reference
    run_dir = run_layout(tmp, layout, LLAMA, f"data.root={corpus_root}", *LAYOUTS[layout])
    assert_same_curve(reference, curves(run_dir))
    if layout == "cp2":  # the ring moves the grouped K/V (2 of 4 heads), not copies per query head
        want = cp2_step_bytes(LLAMA, corpus_root, LAYOUTS[layout])
        assert [v for _, v in read_scalars(run_dir)["comm/cp_bytes"]] == [want] * STEPS


def test_gpt_uneven_splits_checkpoint_and_resume_under_pp(tmp_path, corpus_root):
    """tp=3: 6 heads, 96-wide, the padded vocabulary's 1472 rows split 491/491/490, through validation's generation.
    Stopped at step STOP, its checkpoint (the uneven vocabulary gathered whole) resumes under tp3 (sliced back)
    and under pp2 (the tied embedding's two copies read the one saved tensor)."""
    uneven = [*GPT, f"data.root={corpus_root}", "model.embed_dim=96", "model.num_heads=6"]
    reference = curves(run_layout(tmp_path, "single", uneven))
    tp3 = run_layout(tmp_path, "tp3", uneven, "parallel.tp=3", f"trainer.stop_at_step={STOP}")
    saved = read_shapes(tp3 / "checkpoints" / f"step_{STOP:07d}")
    vocab = serial_shapes(uneven, corpus_root)["tok_embed.weight"]
    assert saved["model/tok_embed.weight"] == saved["optim/lm_head.weight/exp_avg"] == vocab and vocab[0] % 3

    assert_follows_from_the_stop(reference, resume_under(tmp_path, tp3, "tp3_to_pp2", uneven, "parallel=pp2"))
    assert_same_curve(reference, curves(run_layout(tmp_path, "tp3", uneven, "parallel.tp=3")))


def test_dp2_corrupt_replica_file_falls_back_on_every_rank(vit_reference, era5_root):
    """Checkpoints written in the background (trainer.ckpt_async, on their own gloo group). Only rank 1's
    newest file is truncated: both ranks (each reads from it) move to the previous checkpoint together, the
    warning names the file, and the run still follows the uninterrupted curve."""
    reference, tmp = vit_reference
    previous, last = STEPS - 2, STEPS - 1  # a checkpoint every STEPS - 2 steps, then the one of the stop
    args = ["parallel.dp=2", f"trainer.ckpt_every={previous}", "trainer.ckpt_async=true"]
    run_dir = run_layout(tmp, "dp2_corrupt", VIT, f"data.root={era5_root}", *args, f"trainer.stop_at_step={last}")
    log = (run_dir / "train.log").read_text()
    assert all(f"saved checkpoint {run_dir / 'checkpoints'}/step_{s:07d} (in the background)" in log
               for s in (previous, last))
    bad = run_dir / "checkpoints" / f"step_{last:07d}" / "__1_0.distcp"
    bad.write_bytes(bad.read_bytes()[:64])
    run_layout(tmp, "dp2_corrupt", VIT, f"data.root={era5_root}", *args)
    log = (run_dir / "train.log").read_text()  # both runs' lines
    assert f"unreadable checkpoint {bad.parent} (truncated: __1_0.distcp (64 of " in log
    assert "resumed from" in log and f"step_{previous:07d} at step {previous}" in log
    assert_same_curve(reference, curves(run_dir))
