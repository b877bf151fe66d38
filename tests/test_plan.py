"""The layout planner (utils/plan/cost_model.py) against what real runs measure.

Comm bytes per axis: equal to the comm/<axis>_bytes real multi-rank runs log, and the held bytes to their
logged report: checked on the runs tests/test_layouts.py makes anyway (dp2, cp2 x dp2, tp2 x dp2:
`assert_planned`). Parameter, gradient and Adam bytes: equal to a real trainer's after a real step (one
process). Activation bytes: equal to
utils.bench.train_step.saved_for_backward_bytes on real tensors. And the command line: --help, --json, bad input.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
from utils import ConfigError
from utils.plan.cost_model import link_gbs, main, plan_layout, table
from utils.plan.options import GPUS, PCIE_GBS, Hardware, parse_args

TINY = ["trainer.global_batch_size=8"]
RUN = ["trainer.max_steps=1", "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.num_workers=0",
       "trainer.log_images=false"]


def report_of(plan) -> str:
    """utils.engine.build.param_bytes_report's wording, from the planned bytes."""
    n = plan.param_bytes // 4  # fp32 weights
    return (f"this rank holds {n / 1e6:.2f}M parameters: {plan.param_bytes / 2**20:.1f} MiB weights, "
            f"{plan.grad_bytes / 2**20:.1f} MiB gradients, {plan.optimizer_bytes / 2**20:.1f} MiB optimizer state")


def real_step(overrides):
    """A real one-process trainer after one real step: its held bytes and saved-for-backward bytes."""
    import tempfile
    from pathlib import Path

    from utils.bench.train_step import saved_for_backward_bytes
    from utils.cli.config import load_config
    from utils.comm import Grid
    from utils.engine.build import build_trainer
    from utils.tasks import build_task

    cfg = load_config(overrides)[0]
    grid = Grid.serial()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, build_task(cfg, load_data=False), grid, logging.getLogger("t"), Path(tmp))
        x, y = trainer.task.example_batch(cfg.trainer.global_batch_size, grid.device)
        grid.reset_comm_bytes()
        saved = saved_for_backward_bytes(trainer, x, y)
        params = list(trainer.raw_model.parameters())
        state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                    if t.dim() > 0)
        held = (sum(p.numel() * p.element_size() for p in params), sum(p.numel() * p.element_size()
                for p in params if p.requires_grad), state)
        trainer.tb.close()
    return held, saved, grid.comm_bytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_single_process_bytes_equal_a_real_step(precision):
    overrides = TINY + [f"precision={precision}"]
    plan = plan_layout(overrides, GPUS["cpu"], 1)
    held, saved, comm = real_step(overrides)
    assert (plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes) == held
    assert plan.comm_bytes == comm == {}
    assert plan.activation_bytes == saved  # exact (the brief asked for 15%)
    assert plan.step_time_s == pytest.approx(plan.compute_s) and plan.fits


def test_links_follow_the_node_boundary():
    hw = Hardware("H100", 450.0, 50.0, 8, 80.0)
    assert link_gbs(hw, [0, 1, 2, 3]) == 450.0 and link_gbs(hw, [0, 8]) == 50.0


def test_json_has_the_documented_keys(capsys):
    assert main(["--json", "gpu=cpu", "parallel=tp2", *TINY]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["layouts"]
    assert {"comm_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
            "step_time_s"} <= set(plan)
    assert plan["layout"] == "tp2" and set(plan["comm_bytes"]) == {"tp"}
    assert plan["step_time_s"] == pytest.approx(plan["compute_s"] + plan["comm_s"]) and plan["comm_s"] > 0


def test_help_exits_0_without_torch():
    code = "import sys, utils.plan.cost_model as p; assert p.main(['--help']) == 0; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "python -m utils.plan" in proc.stdout


def test_bench_help_exits_0():
    proc = subprocess.run([sys.executable, "-m", "utils.bench", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Benchmark the real train step")


@pytest.mark.parametrize("args,setting", [(["parallel.bogus=1"], "parallel.bogus"), (["gpu=v100"], "gpu"),
                                          (["--world", "x"], "--world"),
                                          (["parallel=pp2", "parallel.pp_microbatches=1"], "parallel.pp_microbatches"),
                                          (["--vocab", "1000"], "--vocab")])
def test_bad_input_is_one_line_exit_2(capsys, args, setting):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error:") and setting in lines[0]


def test_the_rank_player_refuses_a_pipeline_in_one_line(capsys):
    """`python -m utils.plan.rank` steps for real, where torch's pipelining needs real messages: refused before
    any build, pointing at the planner."""
    from utils.plan.rank import main as play_main

    with pytest.raises(SystemExit) as exit_info:
        play_main(["parallel=pp2", "--world", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and "parallel.pp" in lines[0] and "utils.plan" in lines[0]


def test_bad_input_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "utils.plan", "--bogus"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown option '--bogus'")


def test_uneven_refusal_is_listed(capsys):
    """A layout the config refuses (vit_tiny's 4 heads over tp=3) is listed with its one-line reason."""
    assert main(["gpu=cpu", "--world", "3", *TINY]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| tp3 \| refused \| error: .*parallel.tp", out)
    assert torch.distributed.is_initialized() is False


def doctor_file(tmp_path, **fields):
    """A bandwidths file as the doctor writes it (its format: utils/plan/bandwidths.py)."""
    data = {"kind": "dlscale-bandwidths", "version": 1, "date": "2026-11-25", "device": "8x H100", "backend": "nccl",
            "world": 8, "intra_gbs": 310.5, "inter_gbs": None,
            "groups": {"tp": {"size": 8, "spans_nodes": False, "busbw_gbs": {"all_reduce": 310.5}}}}
    path = tmp_path / "bandwidths.json"
    path.write_text(json.dumps({**data, **fields}))
    return str(path)


def test_bandwidths_file_replaces_the_preset_and_flags_win(tmp_path):
    path = doctor_file(tmp_path)
    req = parse_args(["--bandwidths", path, "model=vit_tiny"])
    assert (req.hardware.intra_gbs, req.hardware.inter_gbs) == (310.5, 50.0)  # null keeps the preset's
    assert req.overrides == ["model=vit_tiny"] and path in req.links_from
    req = parse_args([f"--bandwidths={doctor_file(tmp_path, intra_gbs=None, inter_gbs=12)}", "gpu=a100", "--pcie"])
    assert (req.hardware.intra_gbs, req.hardware.inter_gbs) == (PCIE_GBS, 12.0)
    req = parse_args(["--intra-gbs", "100", "--bandwidths", doctor_file(tmp_path, inter_gbs=20.0), "--inter-gbs=7"])
    assert (req.hardware.intra_gbs, req.hardware.inter_gbs) == (100.0, 7.0)
    assert GPUS["h100"].intra_gbs == 450.0  # the preset itself untouched
    assert "(--bandwidths " + path in table([], parse_args(["--bandwidths", path]))


@pytest.mark.parametrize("fields,what", [({"kind": "dlscale-doctor"}, "not a dlscale-bandwidths file"),
                                         ({"version": 2}, "version 2"), ({"intra_gbs": "fast"}, "intra_gbs='fast'"),
                                         ({"inter_gbs": 0}, "inter_gbs=0"), (None, "cannot read"),
                                         ("[", "cannot read")])
def test_bad_bandwidths_file_is_one_line_exit_2(tmp_path, capsys, fields, what):
    if isinstance(fields, dict):
        path = doctor_file(tmp_path, **fields)
    else:
        path = str(tmp_path / "missing.json")
        if fields is not None:
            (tmp_path / "missing.json").write_text(fields)  # not JSON
    with pytest.raises(SystemExit) as exit_info:
        main(["--bandwidths", path, "gpu=cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1
    assert lines[0].startswith("error:") and "--bandwidths" in lines[0] and what in lines[0]


# The fast path (utils/plan/probe.py, utils/engine/build.py values=False) against the old one: the trainer
# built with initialised weights and stepped at its full depth. Each case differs in what it exercises:
# tp with sequence parallelism (ties of sequence regions), cp with activation checkpointing (recomputed
# collectives, the peak in backward), the GPT's tied head and embedding (one tensor after allocation).
# The ViT cases run in the slow tier (tests/conftest.py SLOW_TESTS), the GPT's in the fast one.
VIT_FAST_VS_FULL = [(["parallel=tp2", "parallel.dp=2", "parallel.sequence_parallel=true"], 4),
                    (["parallel=cp2", "parallel.dp=2", "trainer.activation_checkpointing=true"], 4),
                    (["parallel=tp2", "parallel.dp=2", "parallel.dp_mode=fsdp"], 4)]  # FSDP's units extended


def test_probed_meta_plan_equals_the_full_initialised_one():
    assert_fast_equals_full(["model=gpt_tiny", "data=wikitext_sample", "parallel=tp2"], 2)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,world", VIT_FAST_VS_FULL)
def test_probed_meta_plan_equals_the_full_initialised_one_vit(overrides, world):
    assert_fast_equals_full(overrides, world)


# Pipelines, one stage per rank: probed at 2 and 3 blocks per stage, extended to 4; every rank of the pipeline
PIPELINES = [(["model=gpt_tiny", "data=wikitext_sample", "model.depth=8", "parallel=pp2"], 2, (0, 1)),
             (["model=gpt_tiny", "data=wikitext_sample", "model.depth=8", "parallel=pp2", "parallel.dp=2",
               "parallel.dp_mode=fsdp"], 4, (0, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,world,ranks", PIPELINES)
def test_probed_pipeline_plan_equals_the_full_one(overrides, world, ranks):
    assert_fast_equals_full(overrides, world, (4, 6), ranks)


def test_a_pipeline_plan_holds_the_microbatches_its_schedule_has_in_flight():
    """pp2, 4 microbatches: GPipe runs every forward before any backward (4 in flight on both ranks), 1F1B
    at most 2 on the first stage and 1 on the last; the saved bytes follow (a microbatch's forward saves the
    same in both). Without `rank` the rank holding the most is planned: the last stage, with the head's
    logits. The step time adds the bubble, (p-1)/(m+p-1) = 1/5 of the step: compute x 1/4."""
    base = [*TINY, "model=gpt_tiny", "data=wikitext_sample", "parallel=pp2", "parallel.pp_microbatches=4"]
    saved = {(schedule, rank): plan_layout(base + [f"parallel.pp_schedule={schedule}"], GPUS["cpu"], 2, rank=rank)
             .activation_bytes for schedule in ("gpipe", "1f1b") for rank in (0, 1)}
    assert saved["gpipe", 0] / saved["1f1b", 0] == pytest.approx(2, rel=0.01)
    assert saved["gpipe", 1] / saved["1f1b", 1] == pytest.approx(4, rel=0.01)
    plan = plan_layout(base, GPUS["cpu"], 2)
    assert plan.rank == 1 and plan.activation_bytes == saved["1f1b", 1]
    assert plan.bubble_s == pytest.approx(plan.compute_s / 4) and plan.step_time_s == pytest.approx(
        plan.compute_s + plan.bubble_s + plan.comm_s)
    assert "| 1 | pp2 (rank 1) | yes |" in table([plan], parse_args(["gpu=cpu"]))


def assert_fast_equals_full(overrides, world, probes=(1, 2), ranks=(0,)):
    """Every figure of each rank, bit for bit, and the axes in the same order; the figures of the configured
    depth (4, or 8 under pp2) come from the `probes` depths."""
    from dataclasses import asdict

    from utils.plan.cost_model import configured_probes
    from utils.plan.probe import LayoutConfigs

    assert configured_probes(LayoutConfigs(TINY + overrides)) == probes
    for rank in ranks:
        fast = asdict(plan_layout(TINY + overrides, GPUS["cpu"], world, rank=rank))
        full = asdict(plan_layout(TINY + overrides, GPUS["cpu"], world, values=True, probe=False, rank=rank))
        assert fast == full and list(fast["comm_bytes"]) == list(full["comm_bytes"])
        assert fast["activation_bytes"] > 0 and all(n > 0 for k, n in fast["comm_bytes"].items() if "_" not in k)


def test_blocks_off_the_line_are_measured_at_full_depth(monkeypatch):
    import utils.plan.probe as probe

    counts = {1: 10, 2: 15, 4: 25, 5: 31}  # 4 on the line through depths 1 and 2, 5 off it
    monkeypatch.setattr(probe, "serial_params", lambda configs, depth: counts[depth])
    assert probe.probe_depths(None, 4) == (1, 2) and probe.probe_depths(None, 5) == (5,)
    assert probe.probe_depths(None, 2) == (2,)  # no deeper than the probes: measured as is
    assert list(probe.extend({"tp": 3, "dp": 1}, {"dp": 2, "tp": 5}, 1, 4).items()) == [("dp", 4), ("tp", 9)]


def test_one_composition_gives_each_layout_the_config_load_config_gives():
    from utils.cli.config import load_config
    from utils.plan.probe import LayoutConfigs

    configs = LayoutConfigs(TINY + ["parallel=tp2"])
    settings = {"parallel.tp": 4, "parallel.dp": 2, "model.depth": 1}
    assert configs.load(settings) == load_config(TINY + ["parallel=tp2", "parallel.tp=4", "parallel.dp=2",
                                                         "model.depth=1"])[0]
    with pytest.raises(ConfigError) as ours:
        configs.load({"parallel.tp": 3})
    with pytest.raises(ConfigError) as theirs:
        load_config(TINY + ["parallel=tp2", "parallel.tp=3"])
    assert ours.value.line() == theirs.value.line()


def test_unset_sequence_parallelism_is_resolved_for_the_planned_device():
    """gpu=h100 plans what a GPU run does (sequence parallelism on), gpu=cpu what a CPU run does (off)."""
    tp_bytes = {sp: plan_layout(TINY + ["parallel=tp2", f"parallel.sequence_parallel={sp}"], GPUS["cpu"], 2).comm_bytes
                for sp in ("true", "false")}
    assert tp_bytes["true"] != tp_bytes["false"]
    assert plan_layout(TINY + ["parallel=tp2"], GPUS["h100"], 2).comm_bytes == tp_bytes["true"]
    assert plan_layout(TINY + ["parallel=tp2"], GPUS["cpu"], 2).comm_bytes == tp_bytes["false"]


def test_forked_workers_give_the_sequential_answer(capsys):
    """--jobs 2 (each layout in a forked process) prints what --jobs 1 prints, ranking and figures."""
    outputs = []
    for jobs in ("1", "2"):
        assert main(["gpu=cpu", "--world", "2", "--jobs", jobs, "--json", "model.depth=1", *TINY]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert sorted(p["layout"] for p in outputs[0]["layouts"]) == ["cp2", "dp2", "tp2"]


FSDP_TINY = ["model=gpt_tiny", "data=wikitext_sample", "model.depth=1", "parallel.dp=2", *TINY]


def padded_bytes(world: int, rank: int | None = None) -> int:
    """fp32 bytes of gpt_tiny's weights (the planner's GPT-2 vocabulary), each cut in `world` dim-0 shards as
    FSDP2 cuts it (rows padded to a multiple of `world`): all of them, or the rows `rank` holds, unpadded."""
    from utils.cli.config import load_config
    from utils.tasks import build_task

    with torch.device("meta"):
        model = build_task(load_config(FSDP_TINY)[0], load_data=False).build_model()
    total = 0
    for p in model.parameters():
        rows, row = p.shape[0], p[0].numel() if p.dim() > 1 else 1
        shard = -(-rows // world)
        total += (shard * world if rank is None else max(0, min(rows - rank * shard, shard))) * row * 4
    return total


def test_fsdp_bytes_are_counted_from_its_own_collectives():
    """dp2 under FSDP, rank 0: its half of the weights, gradients and Adam state; per step every unit gathered in
    forward and again in backward, every gradient reduce-scattered once (3 x (n-1)/n of the padded weights;
    2 x without resharding after forward, as many as DDP's all-reduce); the same activations as under DDP
    (a gathered weight is not an activation); and the gathered units' peak, larger without resharding."""
    ddp = plan_layout(FSDP_TINY, GPUS["cpu"], 2)
    zero3 = plan_layout(FSDP_TINY + ["parallel.dp_mode=fsdp"], GPUS["cpu"], 2)
    zero2 = plan_layout(FSDP_TINY + ["parallel.dp_mode=fsdp", "parallel.fsdp_reshard_after_forward=false"],
                        GPUS["cpu"], 2)
    full, mine = padded_bytes(2), padded_bytes(2, rank=0)
    assert (zero3.param_bytes, zero3.grad_bytes, zero3.optimizer_bytes) == (mine, mine, 2 * mine)
    assert ddp.param_bytes > 1.9 * mine
    metrics = 1024  # the step's own small all-reduces over dp (loss, gradient norm), counted under DDP too
    assert abs(zero3.comm_bytes["dp"] - 3 * full // 2) < metrics and abs(zero2.comm_bytes["dp"] - full) < metrics
    assert abs(ddp.comm_bytes["dp"] - full) < 0.01 * full  # DDP: 2 (n-1)/n of the unpadded gradients
    assert zero3.activation_bytes == zero2.activation_bytes == ddp.activation_bytes and ddp.gathered_bytes == 0
    vocab_rows = 50304 * 128 * 4  # the tied embedding and head, gathered with the root, and its gradient
    assert 2 * vocab_rows < zero3.gathered_bytes <= zero2.gathered_bytes <= 2 * full
    assert zero3.total_bytes == 4 * mine + zero3.activation_bytes + zero3.gathered_bytes


def test_gathered_peak_is_taken_in_backward():
    """Embedding 10, two blocks of 100, head 30, root 5; backward runs head, blocks, embedding."""
    from utils.plan.fsdp import Unit, extend_units, gathered_peak

    units = (Unit(10, False), Unit(100, True), Unit(100, True), Unit(30, False))
    assert gathered_peak(units, 5, True) == 2 * 5 + 100 + 100 + 100  # a block, its gradient, the next prefetched
    assert gathered_peak(units, 5, False) == 2 * 5 + 210 + 100  # the blocks and the embedding still gathered
    # several micro-batches: every unit's unsharded gradient held from the first backward to the last
    assert gathered_peak(units, 5, True, accumulating=True) == 2 * 5 + 100 + 100 + (10 + 100 + 100 + 30)
    assert extend_units(units, 4) == (units[0],) + (units[1],) * 4 + (units[3],)
    assert gathered_peak(extend_units(units, 4), 0, False) == 410 + 100  # 4 blocks, the embedding, a gradient


def test_without_replicas_gradients_and_activations_do_not_add_up():
    """One process (no DDP buckets) with no accumulation: the step's peak counts the larger of the gradients
    and the saved activations (they never live together); with accumulation, dp replicas or a pipeline, both."""
    one = plan_layout(TINY, GPUS["cpu"], 1)
    held = one.param_bytes + one.optimizer_bytes
    assert one.total_bytes == held + max(one.grad_bytes, one.activation_bytes)
    accumulated = plan_layout(TINY + ["trainer.grad_accum_steps=2"], GPUS["cpu"], 1)
    assert accumulated.total_bytes == (accumulated.param_bytes + accumulated.optimizer_bytes
                                       + accumulated.grad_bytes + accumulated.activation_bytes)
    dp2 = plan_layout(TINY + ["parallel.dp=2"], GPUS["cpu"], 2)
    assert dp2.total_bytes == dp2.param_bytes + dp2.optimizer_bytes + dp2.grad_bytes + dp2.activation_bytes
    pp2 = plan_layout(TINY + ["parallel=pp2"], GPUS["cpu"], 2)  # microbatch 1's gradients beside 2's activations
    assert pp2.total_bytes == pp2.param_bytes + pp2.optimizer_bytes + pp2.grad_bytes + pp2.activation_bytes


@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=gpipe",
                                                          "parallel.pp_microbatches=2", "model.depth=4",
                                                          "trainer.global_batch_size=16"]],
                         ids=["dp2", "pp2dp2"])
def test_fsdp_accumulation_reduce_scatters_once_per_step(layout, monkeypatch):
    """One real Trainer.train_step (the planner's fake group, rank 0) with k micro-batches reduce-scatters each FSDP
    unit's gradient once, in the last micro-batch's backward, not k times (FSDP2 reads `no_sync`'s flag in its
    post-backward hook: a backward outside the block synced every micro-batch); under pp the same over
    pp_microbatches x grad_accum_steps microbatches (distributed/pipeline/torch_stages.py). The gathers still
    run per micro-batch, so the bytes grow by k-1 gathers, never by a reduce-scatter."""
    import utils.plan.fsdp as fsdp
    from utils.cli.config import load_config
    from utils.plan.step import measure_layout

    counts, original = [], fsdp.collective_bytes

    def counted(func, args):
        counts.append(func is torch.ops.c10d._reduce_scatter_base_.default)
        return original(func, args)

    monkeypatch.setattr(fsdp, "collective_bytes", counted)
    planned = {}
    for accum in (1, 2, 4):
        counts.clear()
        cfg = load_config([*FSDP_TINY, *layout, "parallel.dp_mode=fsdp", f"trainer.grad_accum_steps={accum}"])[0]
        planned[accum] = measure_layout(cfg, 4 if "parallel.pp=2" in layout else 2)
        planned[accum].reduce_scatters = sum(counts)
    units = len(planned[1].units) + (planned[1].root_bytes > 0)
    assert units >= 2 and [planned[k].reduce_scatters for k in (1, 2, 4)] == [units] * 3, planned
    one, two, four = (planned[k].comm_bytes["dp"] for k in (1, 2, 4))
    assert four - two == 2 * (two - one) > 0  # each extra micro-batch adds its gathers only
    # parallel.fsdp_reduce_every_microbatch: sharded gradients throughout, a reduce-scatter per micro-batch
    counts.clear()
    cfg = load_config([*FSDP_TINY, *layout, "parallel.dp_mode=fsdp", "trainer.grad_accum_steps=2",
                       "parallel.fsdp_reduce_every_microbatch=true"])[0]
    every = measure_layout(cfg, 4 if "parallel.pp=2" in layout else 2)
    backwards = 2 * (2 if "parallel.pp=2" in layout else 1)  # micro-batches x the schedule's microbatches
    assert sum(counts) == backwards * planned[2].reduce_scatters and every.comm_bytes["dp"] > two


# What the plan assumes of the run (utils/plan/workload.py): the vocabulary, the batch, the tokens per sample


def test_the_vocabulary_is_the_runs_own(tmp_path):
    """--vocab, else the data's tokenizer where it can be read without the corpus (a tokenizer.json, the index of
    data=tokens, the BPE's size), else the model preset's published one (llama_8b: Llama 3's 128256, not GPT-2's
    50257), else GPT-2's; each with where it came from. A ViT reads none."""
    from utils.plan.probe import LayoutConfigs

    def vocab(*overrides, flag=None):
        configs = LayoutConfigs(list(overrides), flag)
        return configs.vocab, configs.vocab_from

    assert vocab("model=llama_8b", "data=wikitext")[0] == 128256
    assert "model=llama_8b: Llama 3's" in vocab("model=llama_8b", "data=wikitext")[1]
    assert vocab("model=llama_8b", "data=wikitext", flag=1000) == (1000, "--vocab")
    assert vocab("model=gpt_tiny", "data=wikitext_sample")[0] == 50257
    assert vocab("model=llama_8b", "data=wikitext", "data.tokenizer=bpe")[0] == 8192
    folder = tmp_path / "tok"
    folder.mkdir()
    words = {"<|endoftext|>": 0, "a": 1, "b": 2}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "a"}}))
    assert vocab("model=llama_8b", "data=wikitext", f"data.tokenizer={folder}") == (3, f"data.tokenizer={folder}")
    shard = {"tokens_file": "0.bin", "documents_file": "0.docs", "num_documents": 1, "num_tokens": 9, "dtype": "uint16",
             "sha256": "", "documents_sha256": ""}
    (tmp_path / "index.json").write_text(json.dumps({
        "format": "dlscale-tokens", "version": 1, "shards": [shard],
        "tokenizer": {"name": "toy", "vocab_size": 777, "eos_id": 0, "fingerprint": "f"}}))
    assert vocab("model=llama_8b", "data=tokens", f"data.root={tmp_path}")[0] == 777
    assert vocab("model=llama_8b", "data=tokens")[0] == 128256  # no root: the preset's
    assert vocab()[0] is None
    with pytest.raises(ConfigError, match="--vocab"):
        vocab(flag=1000)


def test_world_plans_a_cluster_sized_batch_and_says_so(capsys, monkeypatch):
    """--world N without a batch of the user's plans N x the one-process 16 (the old 16 refused dp64 at --world 64),
    sets it on every layout, and names it, the vocabulary and the tokens per sample in the header and the JSON;
    an override or an experiment preset keeps its own batch. The search tells its progress on stderr."""
    import utils.plan.report as report
    from utils.plan.probe import LayoutConfigs
    from utils.plan.workload import workload

    assumed = workload(LayoutConfigs(["model=llama_8b", "data=wikitext"]), 64)
    assert (assumed.global_batch, assumed.settings) == (1024, {"trainer.global_batch_size": 1024})
    assert "--world 64 x 16" in assumed.line() and "256 tokens per sample (data.seq_len)" in assumed.line()
    assert "vocabulary 128256" in assumed.line()
    assert workload(LayoutConfigs(["trainer.global_batch_size=32"]), 64).global_batch == 32
    assert workload(LayoutConfigs(["experiment=mp_bs16", "data=era5_synthetic"]), 64).global_batch == 16
    assert workload(LayoutConfigs([]), 0).global_batch == 16  # one layout: its configured batch
    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    assert main(["gpu=cpu", "--world", "2", "--jobs", "1", "--json", "model.depth=1"]) == 0
    out, err = capsys.readouterr()
    planned = json.loads(out)
    assert planned["workload"]["global_batch"] == 32 and planned["workload"]["vocab"] is None
    assert all("trainer.global_batch_size=32" in p["overrides"] for p in planned["layouts"])
    assert err.splitlines() == [f"planned {i}/3 layouts of 2 ranks, {s}" for i, s in
                                zip((1, 2, 3), re.findall(r"(\d+ s)$", err, re.M))]
    assert main(["gpu=cpu", "--world", "1", "model.depth=1"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header == ("workload: global batch 16 (--world 1 x 16, the one-process default per rank: "
                      "trainer.global_batch_size unset; set it to plan another), 128 tokens per sample "
                      "(data.img_size / model.patch_size)")


def test_a_layout_that_does_not_fit_says_what_shrinks_it():
    """The hint names the largest part and its settings; zero comm axes stay out of the comm column."""
    from utils.cli.config import load_config
    from utils.plan.cost_model import LayoutPlan
    from utils.plan.report import fit_hint

    plan = plan_layout(TINY, Hardware(0.2, 5.0, 5.0, 1000, 1e-3, device="cpu"), 1)
    assert not plan.fits and plan.to_fit.startswith("activations ")
    assert "trainer.activation_checkpointing=true" in plan.to_fit
    cfg = load_config(TINY + ["parallel.dp=2"])[0]
    state = LayoutPlan("dp2", [], param_bytes=2**30, grad_bytes=2**30, optimizer_bytes=2**31, activation_bytes=10)
    assert fit_hint(state, cfg) == "weights+grads+Adam 4.0 GiB: parallel.dp_mode=fsdp, more tp/pp"
    state.fits, state.to_fit = False, fit_hint(state, cfg)
    state.comm_bytes = {"dp": 4_000_000, "tp_dp": 12, "cp": 0}
    row = table([state], parse_args(["gpu=cpu"])).splitlines()[-1]
    assert "| dp 4.0 | weights+grads+Adam 4.0 GiB" in row and "tp_dp" not in row and "cp " not in row
