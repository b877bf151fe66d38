"""The divergence localiser: fingerprints recorded by `trainer.fingerprint_steps` (utils/engine/fingerprints.py)
and `python -m utils.compare --diverge` (utils/compare/diverge.py).

Runs of the tiny language model (2 blocks, 2 steps) through the real entry point on pooled ranks: tp2 (the
outputs of attention and MLP copies on both ranks), tp2 with sequence parallelism and activation checkpointing
(token shards, recomputed forwards), cp2 (the ring's token shards), dp2 with accumulation (batch shards, the
loss normalised per rank and micro-batch) and pp2 (the pipeline's path, with the tied embedding on both ends)
agree with one process, activations and output gradients included; a defect planted in a backward on one tp
rank (the gradient that reaches the output of blocks.0.mlp.fc1 scaled by 1.5 on rank 1, so every parameter
from fc1 back to the input parts, fc2 and the later blocks not) is found at step 1, in the gradient pass, in
module blocks.0.mlp.fc1: the scan in backward order stops there, where a scan in definition order would
blame the embedding; a defect planted in a forward on one tp rank (rank 1's heads of the attention core of
blocks.1 scaled by 1.5) is found in the forward pass at blocks.1.attn.attend, where the parameter gradients
alone could only name the last module; a dp replica whose reduced gradient of the final norm is changed after
the reduction is found there and named (rank 1); and a run with another learning rate parts at step 1's update, not
its gradient, in the last module defined (the final norm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import NARROW, QUIET, TINY_GPT
from tests.rank_pool import pool, run_entry_ranks
from utils import ConfigError
from utils.compare.diverge import deviation, first_divergence
from utils.compare.report import main as compare_main
from utils.engine.fingerprints import merge

ARGS = [*TINY_GPT, *NARROW, *QUIET, "model.depth=2", "trainer.max_steps=2", "trainer.global_batch_size=8",
        "data.limit_eval_tokens=1024", "trainer.fingerprint_steps=2"]
LAYOUTS = {"single": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"],
           "tp2_sp_ac": ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.activation_checkpointing=true"],
           "dp2_accum2": ["parallel.dp=2", "trainer.grad_accum_steps=2"],
           "planted": ["parallel.tp=2"], "planted_forward": ["parallel.tp=2"], "planted_replica": ["parallel.dp=2"],
           "lr": ["optim.lr=3e-3"]}
PLANTED = "blocks.0.mlp.fc2"  # its input's gradient is scaled on tp rank 1: fc1 and everything before it part
PLANTED_FORWARD = "blocks.1.attn.attend"  # its output (rank 1's heads) is scaled on tp rank 1


def planted_entry(rank: int, world: int, argv: list[str], where: str) -> int:
    """The entry point on a pooled rank, with the defect planted on rank 1 (undone before the rank's next case):
    in the backward of PLANTED, in the forward of PLANTED_FORWARD, or in rank 1's copy of the final norm's
    reduced gradient (a dp replica)."""
    from tests.rank_pool import _entry
    from utils.engine.trainer import Trainer

    fit, finish_grads = Trainer.fit, Trainer.finish_grads
    forward = where == "planted_forward"

    def replica_finish_grads(self):
        finish_grads(self)
        if self.grid.global_rank == 1:
            self.raw_model.get_parameter("norm.weight").grad.mul_(1.5)

    def scale_input_grad(module, args) -> None:
        if args[0].requires_grad:
            args[0].register_hook(lambda grad: grad * 1.5)

    def planted_fit(self):
        if self.grid.global_rank == 1 and forward:
            self.raw_model.get_submodule(PLANTED_FORWARD).register_forward_hook(lambda m, a, out: out * 1.5)
        elif self.grid.global_rank == 1:
            self.raw_model.get_submodule(PLANTED).register_forward_pre_hook(scale_input_grad)
        return fit(self)

    Trainer.fit = planted_fit
    if where == "planted_replica":
        Trainer.fit, Trainer.finish_grads = fit, replica_finish_grads
    try:
        return _entry(rank, world, argv)
    finally:
        Trainer.fit, Trainer.finish_grads = fit, finish_grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_root):
    """run(name) -> the run directory of LAYOUTS[name], trained once per module."""
    root, done = tmp_path_factory.mktemp("fingerprints"), {}

    def run(name: str) -> Path:
        if name not in done:
            argv = [*ARGS, f"data.root={corpus_root}", f"run.dir={root / name}", *LAYOUTS[name]]
            world = 1 if name in ("single", "lr") else 2
            results = (pool().run(planted_entry, world, argv, name, timeout_s=180)
                       if name.startswith("planted") else run_entry_ranks(argv, world))
            assert [r.value for r in results] == [0] * world, results[0].error or results[0].stderr[-3000:]
            done[name] = root / name
        return done[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp_ac", "cp2", "dp2_accum2", "pp2"])
def test_a_layout_agrees_with_one_process(layout, runs, capsys):
    single, other = runs("single"), runs(layout)
    recorded = json.loads((other / "fingerprints.json").read_text())
    assert sorted(recorded["steps"]) == ["1", "2"] and "tok_embed.weight" in recorded["order"]
    assert recorded["modules"] == json.loads((single / "fingerprints.json").read_text())["modules"]
    assert {"blocks.1.attn.attend", "blocks.0.mlp", "lm_head"} <= set(recorded["steps"]["2"]["out_grad"])
    assert first_divergence(single, other, 1e-4) is None
    assert compare_main(["--diverge", str(single), str(other)]) == 0
    assert "no divergence over 2 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_a_defect_on_one_tp_rank_is_found_in_its_module(runs, capsys):
    expected = "step 1, gradient pass, module blocks.0.mlp.fc1 (parameter blocks.0.mlp.fc1.bias)"
    assert first_divergence(runs("single"), runs("planted"), 1e-4) == expected
    assert compare_main(["--diverge", str(runs("single")), str(runs("planted"))]) == 1
    out = capsys.readouterr().out
    assert f"first divergence: {expected}" in out
    assert "step 1 forward: agree" in out and "step 1 gradient: 12 of 28 part" in out  # fc1, the 10 before it, 2
    # of the embedding


@pytest.mark.slow
def test_a_forward_defect_on_one_tp_rank_is_found_in_its_module(runs):
    expected = "step 1, forward pass, module blocks.1.attn.attend"
    assert first_divergence(runs("single"), runs("planted_forward"), 1e-4) == expected


@pytest.mark.slow
def test_a_dp_replica_that_parts_is_named(runs):
    recorded = json.loads((runs("planted_replica") / "fingerprints.json").read_text())
    assert recorded["steps"]["1"]["replicas"]["grad"] == {"norm.weight": [1]}
    assert "replicas" not in json.loads((runs("tp2") / "fingerprints.json").read_text())["steps"]["1"]
    expected = "step 1, gradient pass, module norm (parameter norm.weight), on rank 1 of B"
    assert first_divergence(runs("single"), runs("planted_replica"), 1e-4) == expected


@pytest.mark.slow
def test_another_learning_rate_parts_at_the_first_update(runs):
    expected = "step 1, update pass, module norm (parameter norm.bias)"  # the gradients equal, the last module
    assert first_divergence(runs("single"), runs("lr"), 1e-4) == expected


def test_missing_fingerprints_are_refused_with_one_line(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    with pytest.raises(SystemExit) as exit_:
        compare_main(["--diverge", str(tmp_path / "a"), str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "fingerprints.json does not exist" in err and "trainer.fingerprint_steps" in err


def test_fingerprint_steps_must_not_be_negative():
    from utils.schema import TrainerConfig

    with pytest.raises(ConfigError, match="trainer.fingerprint_steps"):
        TrainerConfig(fingerprint_steps=-1)


def test_merge_counts_each_box_once_and_orders_by_stage():
    """Two tp ranks each hold half of `w` and a whole replicated `b` (counted once), a dp replica repeats
    rank 0 (counted once), and a second pipeline stage's `head` sorts after them whatever the rank."""
    def stats(x: float) -> dict:
        return {"grad": [x, x * x, abs(x)], "update": [-x, x * x, abs(x), -x * x, x * x]}

    rank0 = [("w", (0, 0), (2, 4), (0, 0), stats(1.0)), ("b", (0,), (4,), (0, 1), stats(3.0))]
    rank1 = [("w", (2, 0), (2, 4), (0, 0), stats(2.0)), ("b", (0,), (4,), (0, 1), stats(3.0))]
    stage1 = [("head", (0, 0), (4, 4), (1, 0), stats(-5.0))]
    totals, order = merge([stage1, rank0, rank1, list(rank0)])
    assert order == ["w", "b", "head"]
    assert totals["grad"] == {"w": [3.0, 5.0, 3.0], "b": [3.0, 9.0, 3.0], "head": [-5.0, 25.0, 5.0]}
    assert totals["update"]["w"] == [-3.0, 5.0, 3.0, -5.0, 5.0]


def test_deviation_scales_a_sum_by_its_absolute_sum():
    assert deviation([1e-9, 4.0, 8.0], [-1e-9, 4.0, 8.0]) < 1e-9  # a sum that cancels: as exact as |x| allows
    assert deviation([1.0, 4.0, 8.0], [1.0, 4.0, 8.4]) == pytest.approx(0.4 / 8.4)
    assert deviation([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]) == 0.0
    assert deviation([float("nan"), 1.0, 1.0], [1.0, 1.0, 1.0]) == float("inf")


def test_an_update_is_judged_by_its_gradient_weighted_statistics():
    """An update's [sum, sumsq, abssum, sum u*g, sum |u*g|]: noise in elements of no gradient (the first three
    differ) is not a deviation; a changed sum(u*g) is."""
    assert deviation([0.5, 1.0, 2.0, -3.0, 4.0], [-0.5, 1.5, 2.5, -3.0, 4.0]) == 0.0
    assert deviation([0.5, 1.0, 2.0, -3.0, 4.0], [0.5, 1.0, 2.0, -2.0, 4.0]) == pytest.approx(0.25)


def _fingerprints(folder: Path, names: list[str], arch: str | None = None) -> Path:
    """A run directory holding fingerprints of one step of `names` (each the same statistics), and a task.json."""
    folder.mkdir()
    grads = {n: [0.5, 1.0, 2.0] for n in names}
    updates = {n: [-0.1, 0.01, 0.2, -0.05, 0.05] for n in names}
    record = {"precision": "bf16", "layout": "test", "order": names, "steps": {"1": {"grad": grads, "update": updates}}}
    (folder / "fingerprints.json").write_text(json.dumps(record))
    if arch:
        (folder / "task.json").write_text(json.dumps({"arch": arch}))
    return folder


def test_a_parameter_one_run_lacks_is_a_divergence_named(tmp_path, capsys):
    """A parameter present in one run's fingerprints and absent from the other's parts there (deviation inf),
    whatever the tolerance, and the report names it and the run that lacks it; the others agree."""
    full = _fingerprints(tmp_path / "full", ["embed.weight", "blocks.0.mlp.fc1.bias", "norm.weight"], "gpt")
    lacking = _fingerprints(tmp_path / "lacking", ["embed.weight", "norm.weight"], "gpt")
    expected = "step 1, gradient pass, module blocks.0.mlp.fc1 (parameter blocks.0.mlp.fc1.bias), missing from B"
    assert first_divergence(full, lacking, 1.0) == expected
    assert first_divergence(lacking, full) == expected.replace("from B", "from A")
    assert compare_main(["--diverge", str(full), str(lacking)]) == 1
    out = capsys.readouterr().out
    assert "step 1 gradient: 1 of 3 part (largest deviation inf, blocks.0.mlp.fc1.bias)" in out
    assert "blocks.0.mlp.fc1.bias: recorded by A only, missing from B" in out
    assert f"first divergence: {expected}, deviation inf > " in out


def test_runs_of_different_models_are_refused_with_one_line(tmp_path, capsys):
    a = _fingerprints(tmp_path / "a", ["embed.weight"], "gpt")
    b = _fingerprints(tmp_path / "b", ["embed.weight"], "llama")
    with pytest.raises(SystemExit) as exit_:
        compare_main(["--diverge", str(a), str(b)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "different models" in err


def test_equal_parts_of_other_samples_add_up():
    """Activation statistics from ranks of other batch slices (dp) add up even where they are equal (two dp ranks'
    packed rows can hold the same positions: a position embedding's output was counted once, half the
    single-process figure); identical rows within one slice are copies (tp without sp, cp before the sequence is
    split) and count once."""
    from utils.engine.fingerprints import merge_activations

    where = {"pos_embed": [0, 0, 0]}
    row = {"forward": {"pos_embed": [1.0, 2.0, 3.0]}, "out_grad": {}}
    ranks = [{"stats": row, "where": where, "slice": dp} for dp in (0, 1) for _tp_or_cp in (0, 1)]
    totals, modules = merge_activations(ranks)
    assert totals["forward"]["pos_embed"] == [2.0, 4.0, 6.0] and modules == ["pos_embed"]
