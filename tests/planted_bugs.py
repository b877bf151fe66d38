"""Prove the combination matrix by breaking things: `python -m tests.planted_bugs [NAME ...] [--first]
[--report FILE]`.

Each plant is a realistic defect of one mechanism (dp averaging, a tp mapping, a cp variant, the pipeline's
loss scaling, FSDP's precision, the initialisation, a refusal check, ...), written as text edits that must each
match the code exactly once (a plant that no longer fits the code fails loudly instead of testing nothing). The
planted text calls `_plant_hit()`, which the harness appends to each edited file: it touches a marker file,
so a plant whose code never ran is reported as such; where the line also runs in the single-process reference,
the planted text calls it only where the defect changes something.

Each edit's site is marked in the source: a comment `# plant: NAME` (`# plant: a, b` for several plants) at the end of
the line where the edit's fixed text starts, or alone on the line above as `# plant: NAME (next line)` where the
line would pass 120 columns. `locate` finds an edit's file by that marker in every Python file outside tests/, the
file stored in the plant being a hint only, so code moved between files or folders keeps its plants as long as the
comment moves with its line; the fixed text must occur once in the marker's file, starting on the line it marks,
and every marker must mark an edit of its plant (`Misfit` otherwise, naming the plant, the marker and what to do:
tests/test_planted_bugs.py checks each plant in the fast tier, and that no marker names an unknown plant). The
planted text replaces the fixed text; a marker after it on the line stays. For each plant:

1. the tree is copied and planted, and the matrix cases the plant targets (`Plant.targets`, over the
   covering set of tests/matrix.py as cached for the unplanted tree, cheapest first; refused cases too for a
   plant in a refusal check), or its own tests outside the matrix (`Plant.tests`: code no matrix case can
   observe, such as a Hugging Face import by slices or a forecast score), run on the copy through pytest;
2. a case counts as a kill only when a comparison failed by at least KILL_MARGIN (3) times its bound: a matrix
   comparison (`tests.matrix.Mismatch`: a curve, a gradient norm, the checkpoint's keys and shapes, the attention
   check, an exit status or refusal line the trainer's checks predict; or, where the curves are off by less,
   the worst parameter or module the localiser names, against its tolerance), or outside the matrix a failed
   assertion of the test or of a testing library against an independent oracle (its margin read from the
   message). A planted matrix case off by less than that is skipped as thin and the next case runs. A crash, an
   assert inside the code under test, a setup error or a timeout is a broken plant, not a kill;
3. the killing case must pass on the unplanted copy, at the bound itself (run once per case, cached), or the
   plant is reported as proving nothing (a baseline failure);
4. the marker must exist: the planted path ran (and changed something).

`--first` stops each plant's run at its first kill (CI runs that: .ci/run). The outcome of every case
is read from a file this module writes as a pytest plugin (`-p tests.planted_bugs`). Exit status 0 when every
plant is killed, 1 otherwise. Results: docs/testing.md.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = "tests/planted_bugs.py"  # where the plants live, for the messages
OUTCOMES_VAR, MARKER_VAR = "DLSCALE_PLANT_OUTCOMES", "DLSCALE_PLANT_MARKER"
FROZEN_VAR, KILL_MARGIN_VAR = "DLSCALE_MATRIX_FROZEN", "DLSCALE_KILL_MARGIN"  # read by tests/matrix.py, test_matrix.py
KILL_MARGIN = 3.0  # a kill is a value off by at least 3x its bound (the curves, or a parameter's fingerprint)
ACCEPTED_TEST = "tests/test_matrix.py::test_accepted_combination_follows_the_single_process_run"
REFUSED_TEST = "tests/test_matrix.py::test_refused_combination_exits_2_with_one_line"
HIT = '''

def _plant_hit(value=None):  # appended by tests/planted_bugs.py: the planted code ran
    import os

    if os.environ.get("DLSCALE_PLANT_MARKER"):
        open(os.environ["DLSCALE_PLANT_MARKER"], "a").close()
    return value
'''


@dataclass(frozen=True)
class Plant:
    mechanism: str
    what: str
    # (file, the fixed code's text, the defect's text); the file is a hint: `locate` plants the file of the marker
    edits: tuple[tuple[str, str, str], ...]
    targets: Callable  # Case -> bool: the matrix cases where the mechanism acts
    refused: bool = False  # the refused cases it targets too (a wrong acceptance)
    # (test, parameter id) outside the matrix, for code no matrix case can observe (an import from a Hugging Face
    # folder, a checkpoint read under another layout, a forecast score): run instead of matrix cases, their
    # comparisons against an independent oracle count as kills (`_kind`)
    tests: tuple[tuple[str, str], ...] = ()


def _v_schedule(case) -> bool:
    return case.schedule in ("zbv", "dualpipev")  # first and last stage on the same rank


PLANTS = {
    "ddp_divides_by_dp_x_cp": Plant(
        "dp averaging", "DDP's hook divides the gradients summed over dp x cp by the group size, not by dp",
        (("distributed/data_parallel.py", "ddp.register_comm_hook((axis, grid.batch.size)",
          "ddp.register_comm_hook((axis, _plant_hit(axis.size))"),),
        lambda c: c.dp_mode == "ddp" and c.cp > 1 and c.pp == 1),  # the pipeline reduces dp x cp itself
    "accumulation_syncs_first_micro": Plant(
        "gradient accumulation", "the dp reduction runs after the first micro-batch instead of the last",
        (("utils/engine/trainer.py", "sync = i == micro - 1", "sync = _plant_hit(i == 0)"),),
        lambda c: c.grad_accum_steps > 1 and c.dp_mode is not None and c.pp == 1),
    "pipeline_loss_ignores_accumulation": Plant(
        "pipeline loss scaling", "each microbatch loss is divided by the microbatches of one accumulation step only",
        (("distributed/pipeline/schedule.py", "self.divisor, self.scale = accum * self.plan.microbatches, scale",
          "self.divisor, self.scale = _plant_hit(self.plan.microbatches), scale"),),
        lambda c: c.pp > 1 and c.grad_accum_steps > 1),
    "partial_grads_skip_vectors": Plant(
        "tp partial gradients", "the sum of partial gradients over tp skips 1-D parameters (norms, row biases)",
        (("distributed/data_parallel.py", "        sum_grads(params, axis)\n",
          "        sum_grads(_plant_hit([p for p in params if p.dim() > 1]), axis)\n"),),
        lambda c: c.tp > 1),
    "tp_copy_skips_grad_sum": Plant(
        "tp column/row mapping", "the column-parallel input's backward (Megatron's f) does not all-reduce dX",
        (("distributed/mappings.py", "return all_reduce(grad, ctx.axis), None", "return _plant_hit(grad), None"),),
        lambda c: c.tp > 1 and c.sequence_parallel is False),
    "sp_gather_linear_keeps_own_chunk": Plant(
        "sp gather/scatter", "the sequence-parallel gather before a linear keeps its own chunk of dX, unsummed",
        (("distributed/mappings.py", "grad_x = reduce_scatter(grad.matmul(w), ctx.axis, ctx.dim, ctx.via)",
          "grad_x = own_chunk(_plant_hit(grad.matmul(w)), ctx.axis, ctx.dim).contiguous()"),),
        lambda c: c.tp > 1 and c.sequence_parallel is True),
    "cp_allgather_key_grads_unsummed": Plant(
        "cp all-gather", "K is all-gathered by a gather whose backward keeps the own chunk: dK of other ranks' "
        "queries is lost",
        (("distributed/context/attention.py", "k_all = all_gather_region(k, shards.axis, 2, shards.sizes)",
          "k_all = _plant_hit(gather_from_region)(k, shards.axis, 2, shards.sizes)"),
         ("distributed/context/attention.py", "from distributed.mappings import all_gather_region,",
          "from distributed.mappings import gather_from_region, all_gather_region,")),
        lambda c: c.cp_attention == "allgather"),
    "ring_scores_under_autocast": Plant(
        "cp ring", "the ring's scores, row max, sums and LSE follow autocast (bf16, fp16)",
        (("distributed/context/ring.py", "with torch.autocast(q.device.type, enabled=False):",
          "with _plant_hit(contextlib.nullcontext()):"),
         ("distributed/context/ring.py", "\nimport torch\n", "\nimport contextlib\n\nimport torch\n")),
        lambda c: c.cp_attention == "ring" and c.precision != "fp32"),
    "alltoall_drops_causal": Plant(
        "cp all-to-all", "the all-to-all variant attends without the causal mask",
        (("distributed/context/attention.py", "out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, "
          "is_causal=self.causal,", "out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, "
          "is_causal=_plant_hit(False),"),),
        lambda c: c.cp_attention == "alltoall" and c.model != "vit" and c.packing != "documents"),  # is_causal's path
    "hierarchical_group_positions_reversed": Plant(
        "cp hierarchical", "each all-to-all group's positions are its members' in reverse rank order: the ring "
        "across groups masks by the wrong tokens' positions",
        (("distributed/context/layout.py", "positions = [torch.cat([self.positions[r] for r in m]) for m in members]",
          "positions = [torch.cat([self.positions[r] for r in _plant_hit(m[::-1])]) for m in members]"),),
        lambda c: c.cp_attention == "hierarchical" and c.model != "vit"),
    "fsdp_casts_params_to_bf16": Plant(
        "FSDP mixed precision", "issue 23 item 1: FSDP2's policy casts parameters (and so stage outputs) to bf16",
        (("distributed/fsdp.py", "policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)",
          "policy = MixedPrecisionPolicy(param_dtype=_plant_hit(torch.bfloat16), reduce_dtype=torch.float32)"),
         ),
        lambda c: c.dp_mode == "fsdp" and c.pp == 1),  # under pp the stages' fp32 receive buffers refuse it (a crash)
    "checkpoint_wrapper_names": Plant(
        "activation checkpointing", "issue 23 item 3: Adam state named from named_parameters(), the activation "
        "checkpointing wrapper's prefixes included",
        (("utils/checkpoints/sharded_state.py", "    params = parameter_names(model)\n",
          "    params = (named if (named := dict(model.named_parameters(remove_duplicate=False))).keys() == "
          "parameter_names(model).keys() else _plant_hit(named))\n"),),  # marked only where the names differ
        lambda c: c.activation_checkpointing),
    "tied_embedding_grads_unsummed": Plant(
        "tied embeddings", "the pipeline's first and last stage do not sum their tied embedding gradients",
        (("distributed/pipeline/schedule.py", "all_reduce_(self.tied.grad, ends)", "_plant_hit(self.tied.grad)"),),
        lambda c: c.model == "gpt" and c.pp > 1 and not _v_schedule(c)),
    "init_columns_from_zero": Plant(
        "initialisation", "a column shard draws its rows' values and keeps the first columns, not its own",
        (("networks/initialization.py", "values = values.narrow(dim, offsets[dim], piece.shape[dim])",
          "values = values.narrow(dim, offsets[dim] and _plant_hit(0), piece.shape[dim])"),),  # marked off 0 only
        lambda c: c.tp > 1),
    "pipeline_loss_unscaled": Plant(
        "loss scaler", "the last stage's backward runs on the unscaled loss while the scaler unscales the gradients",
        (("distributed/pipeline/schedule.py", "        return self.scale(loss)\n",
          "        return _plant_hit(loss)\n"),),
        lambda c: c.precision == "fp16" and c.pp > 1),
    "fsdp_reduces_in_bf16": Plant(
        "FSDP reduction precision", "FSDP2's policy reduce-scatters the gradients in bf16 (a common setting for "
        "bandwidth) where the recipe reduces in fp32: every gradient rounded to 8 bits of mantissa",
        (("distributed/fsdp.py", "policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)",
          "policy = MixedPrecisionPolicy(reduce_dtype=_plant_hit(torch.bfloat16))"),),
        lambda c: c.dp_mode == "fsdp"),
    "document_block_unmasked": Plant(
        "document masks", "the ring runs a block that is only partly visible (across a document or the diagonal) "
        "without its mask, as if every pair were visible",
        (("distributed/context/ring.py", "None if bool(m.all()) else m.repeat(1, group, 1)[:, None]",
          "None if bool(m.all()) or _plant_hit(True) else m.repeat(1, group, 1)[:, None]"),),
        lambda c: c.cp_attention in ("ring", "hierarchical") and c.packing == "documents"),
    "hierarchical_accepts_one_group": Plant(
        "refusal checks", "the hierarchical variant's group check accepts cp_a2a = cp (one all-to-all group, "
        "no ring across groups): off by one",
        (("utils/schema.py", "groups_fit = 1 < self.cp_a2a < self.cp and",
          "groups_fit = (1 < self.cp_a2a < self.cp or (self.cp_a2a == self.cp and _plant_hit(True))) and"),),
        lambda c: c.cp_attention == "hierarchical" and c.cp == 2, refused=True),
    "fsdp_norm_skips_shard_sum": Plant(
        "gradient norm", "the gradient norm counts an FSDP-sharded gradient's local squares only, not summed over "
        "the ranks that shard it",
        (("distributed/grad_norm.py", "axes = ((fsdp,) if isinstance(p.grad, DTensor) else ())",
          "axes = ((fsdp,) if isinstance(p.grad, DTensor) and not _plant_hit(True) else ())"),),
        lambda c: c.dp_mode == "fsdp"),
    "box_hands_dcp_a_copy": Plant(
        "checkpoint boxes", "a box hands DCP a copy of its local tensor: a save writes the right values, a load "
        "fills the copy and leaves the model's tensors as they were",
        (("utils/checkpoints/sharded_state.py", "        return self.local\n",
          "        return _plant_hit(self.local.clone())\n"),),
        lambda c: False,
        tests=(("tests/test_checkpoint_boxes.py::test_boxes_save_and_load_without_collectives",
                "uneven-tp2_fsdp2-to-tp3"),)),
    "slice_import_last_row_as_padding": Plant(
        "sliced import", "a box that reaches the end of a padded vocabulary reads its last real row as padding "
        "(zeros): off by one at the boundary",
        (("networks/exchange.py", "real = max(r0, min(r1, rule.real_rows))",
          "real = max(r0, min(r1, rule.real_rows - (r1 >= rule.real_rows and _plant_hit(1))))"),),
        lambda c: False,
        tests=(("tests/test_hf_slices.py::test_every_box_read_by_slices_equals_the_whole_import", "gpt2"),)),
    "crps_not_fair": Plant(
        "forecast ensemble scores", "the fair CRPS's member-pair term divided by M^2 (the standard estimator's) "
        "instead of M (M - 1)",
        (("utils/weather/task/ensemble.py", "x.sort(dim=0).values).sum(dim=0) / (num * (num - 1))",
          "x.sort(dim=0).values).sum(dim=0) / _plant_hit(num * num)"),),
        lambda c: False,
        tests=(("tests/test_ensemble.py::test_fair_crps_equals_scores", "5"),)),
}


# ---- the pytest plugin (`-p tests.planted_bugs`): each matrix case's outcome, classified ----

def pytest_runtest_makereport(item, call):
    path = os.environ.get(OUTCOMES_VAR)
    if not path or call.when == "teardown" or (call.when == "setup" and call.excinfo is None):
        return None
    excinfo = call.excinfo
    matrix = item.nodeid.startswith("tests/test_matrix.py")
    kind, margin = ("passed", None) if excinfo is None else _kind(excinfo, matrix)
    line = "" if excinfo is None else (str(excinfo.value).strip().splitlines() or [excinfo.typename])[0][:300]
    with open(path, "a") as out:
        out.write(json.dumps({"case": item.callspec.id, "kind": kind, "why": line, "margin": margin}) + "\n")
    return None


def _kind(excinfo, matrix: bool) -> tuple[str, float | None]:
    """('mismatch', margin) for a comparison that failed, else ('crash' | 'skipped', None). A comparison: the
    matrix's Mismatch (its `margin`: how many times its bound the value is off), only that in the matrix's tests
    (`matrix`), and outside them an
    AssertionError raised by the test or by a testing library (torch.testing, numpy.testing: the margin read from
    their message; inf for an exact comparison), never one raised inside the code under test."""
    from tests.helpers import in_code_under_test
    from tests.matrix import Mismatch

    if excinfo.typename == "Skipped":
        return "skipped", None
    if excinfo.errisinstance(Mismatch):
        return "mismatch", getattr(excinfo.value, "margin", math.inf)
    if matrix or not excinfo.errisinstance(AssertionError):
        return "crash", None
    if in_code_under_test(str(excinfo.traceback[-1].path)):
        return "crash", None
    return "mismatch", assertion_margin(str(excinfo.value))


def assertion_margin(message: str) -> float:
    """How many times its tolerance a testing library's failed comparison is off: torch.testing's "Greatest
    absolute/relative difference: X ... (up to Y allowed)" (the smaller ratio: an element fails beyond atol +
    rtol x |expected|, so a tolerance of 0 on one side says nothing), numpy's "Max relative difference ...: X"
    over its rtol; inf for an exact comparison (torch's "not equal", no allowance) or a message without figures
    (a plain assert of equality)."""
    torch_style = r"Greatest \w+ difference: ([-+.\deinf]+) .*?\(up to ([-+.\de]+) allowed\)"
    ratios = [float(x) / float(y) if float(y) > 0 else math.inf for x, y in re.findall(torch_style, message)]
    rtol = re.search(r"rtol=([-+.\de]+)", message)
    found = re.search(r"Max relative difference[^:]*: ([-+.\deinf]+)", message)
    if rtol and found:
        ratios.append(float(found.group(1)) / float(rtol.group(1)) if float(rtol.group(1)) > 0 else math.inf)
    return min(ratios, default=math.inf)


# ---- the harness ----

def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones) into `dest`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def plant(tree: Path, edits: tuple[tuple[str, str, str], ...]) -> None:
    """Apply the edits, as `locate` resolved them (each text must occur exactly once), and append `_plant_hit` to
    each edited file."""
    for file, old, new in edits:
        path = tree / file
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"error: the plant's text occurs {text.count(old)} times in {file}, not once: "
                             "update PLANTS in tests/planted_bugs.py")
        path.write_text(text.replace(old, new))
    for file in {file for file, _, _ in edits}:
        with open(tree / file, "a") as out:
            out.write(HIT)


# ---- the markers: `# plant: NAME` on the line an edit's fixed text starts, so that moved code keeps its plants ----

MARKER = re.compile(r"#\s*plant:\s*(?P<names>\w+(?:\s*,\s*\w+)*)\s*(?P<next>\(next line\))?\s*$")


class Misfit(Exception):
    """A plant whose marker or text no longer fits the code; the message names the plant and what to do."""


@dataclass(frozen=True)
class Marker:
    file: str  # relative to the tree
    line: int  # the comment's own line (1-based)
    target: int  # the line it marks: its own, or for a comment alone on its line the next one
    names: tuple[str, ...]

    def where(self) -> str:
        return f"{self.file}:{self.line}" + (" (for the next line)" if self.target != self.line else "")


def source_files(root: Path = ROOT) -> list[str]:
    """The Python files a plant may edit: every one in the tree but tests/ (and hidden or private folders, such as
    .git, .venv, __pycache__), relative to `root`."""
    found = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not (rel == Path() and d == "tests") and not (Path(folder) / d / "pyvenv.cfg").exists())
        found += [(rel / f).as_posix() for f in sorted(files) if f.endswith(".py")]
    return found


def marker_comments(root: Path = ROOT) -> list[tuple[str, int, str, Marker | None]]:
    """(file, line, comment, its Marker or None where malformed) of every comment that mentions `plant:`."""
    files = source_files(root)
    return _marker_comments(root, tuple((f, (root / f).stat().st_mtime_ns, (root / f).stat().st_size) for f in files))


@functools.lru_cache(maxsize=8)
def _marker_comments(root: Path, stamps: tuple) -> list[tuple[str, int, str, Marker | None]]:
    """marker_comments, read again only when a file changed (its mtime or size)."""
    import io
    import tokenize

    found = []
    for file, _, _ in stamps:
        text = (root / file).read_text()
        if "plant:" not in text:
            continue
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.COMMENT or not re.search(r"#\s*plant:", tok.string):
                continue
            line, m = tok.start[0], MARKER.search(tok.string)
            alone = tok.line.strip() == tok.string.strip()
            names = tuple(n.strip() for n in m.group("names").split(",")) if m else ()
            found.append((file, line, tok.string, m and Marker(file, line, line + alone, names)))
    return found


def markers(root: Path = ROOT) -> dict[str, list[Marker]]:
    """Each plant name's markers in the source."""
    found: dict[str, list[Marker]] = {}
    for _, _, _, marker in marker_comments(root):
        for name in marker.names if marker else ():
            found.setdefault(name, []).append(marker)
    return found


def stale_markers(root: Path = ROOT) -> list[str]:
    """A message for each `plant:` comment in the source that names no plant of PLANTS or is malformed."""
    found = []
    for file, line, comment, marker in marker_comments(root):
        if marker is None:
            found.append(f"{file}:{line}: `{comment.strip()}` is not a marker: write `# plant: NAME[, NAME]` at the "
                         "end of the line, or `# plant: NAME (next line)` alone on the line above")
        for name in marker.names if marker else ():
            if name not in PLANTS:
                found.append(f"{file}:{line}: the marker `# plant: {name}` names no plant of {HERE}: remove it, "
                             "or rename it after the plant's new name")
    return found


def _start_line(text: str, old: str) -> int:
    """The line where the (single) match of `old` in `text` starts: its first character that is not a newline."""
    start = text.index(old) + len(old) - len(old.lstrip("\n"))
    return text.count("\n", 0, start) + 1


def _occurrences(root: Path, old: str) -> list[str]:
    """file:line of each match of `old` in the source."""
    found = []
    for file in source_files(root):
        text, at = (root / file).read_text(), -1
        while (at := text.find(old, at + 1)) >= 0:
            start = at + len(old) - len(old.lstrip("\n"))
            found.append(f"{file}:{text.count(chr(10), 0, start) + 1}")
    return found


def locate(name: str, root: Path = ROOT) -> tuple[tuple[str, str, str], ...]:
    """Plant `name`'s edits with the file each applies to, found by its marker `# plant: name` in the source (the
    file stored in the plant is a hint, for the messages): each edit's fixed text occurs exactly once in the marker's
    file, starting on the line the marker marks, and every marker of the plant marks one of its edits. Misfit
    otherwise, naming the plant, the marker and what to do."""
    tag, found = f"`# plant: {name}`", markers(root).get(name, [])
    located, used = [], []
    for hint, old, new in PLANTS[name].edits:
        free = [m for m in found if m not in used]
        fits = [m for m in free if (text := (root / m.file).read_text()).count(old) == 1
                and _start_line(text, old) == m.target]
        if not fits:
            raise Misfit(_misfit(name, tag, root, hint, old, free))
        used.append(fits[0])
        located.append((fits[0].file, old, new))
    if extra := [m for m in found if m not in used]:
        raise Misfit(f"plant {name}: its marker {tag} on {', '.join(m.where() for m in extra)} marks none of the "
                     f"plant's edits (marked on {', '.join(m.where() for m in used)}): remove the stale marker, or "
                     f"add the edit it marks to the plant in {HERE}")
    return tuple(located)


def _misfit(name: str, tag: str, root: Path, hint: str, old: str, free: list[Marker]) -> str:
    short = old.strip("\n").splitlines()[0].strip()
    short = f"`{short[:70]}{'...' if len(short) > 70 else ''}`"
    where = _occurrences(root, old)
    at = ("it occurs nowhere in the source" if not where else f"it is on {where[0]}" if len(where) == 1 else
          f"it occurs {len(where)} times: {', '.join(where)}")
    if not free:
        if not where:
            return (f"plant {name}: no marker {tag} in the source and its fixed text {short} (last seen in {hint}) "
                    "occurs nowhere: update the plant's text in tests/planted_bugs.py and mark the line it starts on")
        return (f"plant {name}: no marker {tag} in the source (the fixed text {short} {at.removeprefix('it ')}): end "
                f"the line the text starts on with `  # plant: {name}`, or where that line would pass 120 columns put "
                f"`# plant: {name} (next line)` alone on the line above")
    marker, more = free[0], "".join(f", {m.where()}" for m in free[1:])
    head = f"plant {name}: its marker {tag} is on {marker.where()}{more}"
    line = "that line" if marker.target == marker.line else f"the line it marks, {marker.file}:{marker.target}"
    if (here := sum(w.startswith(f"{marker.file}:") for w in where)) > 1:
        return (f"{head} but the fixed text {short} occurs {here} times in {marker.file}, not once ({at}): lengthen "
                "the plant's text in tests/planted_bugs.py until it matches once")
    todo = "move the marker with the line, or update" if where else "update"
    return f"{head} but the fixed text {short} is not on {line} ({at}): {todo} the plant's text in {HERE}"


def targeted(p: Plant) -> list[tuple[str, str]]:
    """(test, case id) of the matrix cases `p` targets, fp32 first (the cheapest on any CPU), then by size; or the
    plant's own tests outside the matrix."""
    from tests.matrix import covering_set

    if p.tests:
        return list(p.tests)

    accepted, refused = covering_set()
    cases = [(ACCEPTED_TEST, c) for c in accepted if p.targets(c)]
    cases += [(REFUSED_TEST, c) for c, _ in refused if p.refused and p.targets(c)]
    cases.sort(key=lambda tc: (tc[1].precision != "fp32", tc[1].world, tc[1].grad_accum_steps, tc[1].name))
    return [(test, c.name) for test, c in cases]


def run_cases(tree: Path, cases: list[tuple[str, str]], first: bool, marker: Path | None = None) -> list[dict]:
    """Each case's outcome ({case, kind, why}) of a pytest run of `cases` on `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        outcomes = Path(f.name)
    # the unplanted covering set (a plant in a check would move cases between accepted and refused), and the
    # margin a planted run must exceed to kill (KILL_MARGIN x the bound); the unplanted control at the bound
    env = {**os.environ, OUTCOMES_VAR: str(outcomes), FROZEN_VAR: "1", KILL_MARGIN_VAR: "1"}
    env.pop(MARKER_VAR, None)
    if marker is not None:
        env[MARKER_VAR], env[KILL_MARGIN_VAR] = str(marker), str(KILL_MARGIN)
    args = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-p",
            "tests.planted_bugs", *(["-x"] if first else []), *(f"{test}[{case}]" for test, case in cases)]
    proc = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in outcomes.read_text().splitlines()]
    outcomes.unlink()
    if not rows and proc.returncode != 0:  # nothing ran: a collection error of the planted copy
        last = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["?"])[-1]
        rows = [{"case": "collection", "kind": "crash", "why": last}]
    return rows


@dataclass
class Verdict:
    name: str
    status: str  # killed, survived, thin, broken, baseline
    case: str = ""
    why: str = ""
    cases_run: int = 0
    targeted: int = 0
    seconds: float = 0.0
    margin: float | None = None  # a kill's: how many times its bound the killing value is off (inf: exact)

    def line(self) -> str:
        p = PLANTS[self.name]
        margin = "" if self.margin is None else f" [margin {self.margin:.3g}x]"
        where = {"killed": f"by {self.case}: {self.why}{margin}",
                 "survived": f"{self.cases_run} of {self.targeted} cases passed",
                 "thin": f"{self.case} is off by less than {KILL_MARGIN:g}x its bound: {self.why}",
                 "broken": f"{self.case}: {self.why}",
                 "baseline": f"{self.case} fails unplanted too: {self.why}"}[self.status]
        return f"{self.name} ({p.mechanism}): {self.status.upper()} {where} [{self.seconds:.0f} s]"


def _thin(row: dict) -> bool:
    """A matrix case whose planted run was off, by less than KILL_MARGIN x its bound (tests/test_matrix.py skips it)."""
    return row["kind"] == "skipped" and row["why"].startswith("thin:")


class Harness:
    def __init__(self, workdir: Path, first: bool):
        self.workdir, self.first = workdir, first
        self.base: Path | None = None
        self.baseline: dict[tuple[str, str], dict] = {}

    def unplanted(self, test: str, case: str) -> dict:
        if self.base is None:
            self.base = self.workdir / "unplanted"
            copy_tree(self.base)
        if (test, case) not in self.baseline:
            self.baseline[(test, case)] = run_cases(self.base, [(test, case)], True)[0]
        return self.baseline[(test, case)]

    def judge(self, name: str) -> Verdict:
        start, p = time.monotonic(), PLANTS[name]
        cases = targeted(p)
        verdict = Verdict(name, "survived", targeted=len(cases))
        if not cases:
            verdict.status, verdict.case, verdict.why = "broken", "-", "no matrix case targets it"
            return verdict
        try:
            edits = locate(name)
        except Misfit as misfit:
            verdict.status, verdict.case, verdict.why = "broken", "-", str(misfit)
            return verdict
        tree, marker = self.workdir / name, self.workdir / f"{name}.hit"
        copy_tree(tree)
        plant(tree, edits)
        rows = run_cases(tree, cases, self.first, marker)
        verdict.cases_run = sum(r["kind"] in ("passed", "mismatch", "crash") or _thin(r) for r in rows)
        thin = [r for r in rows if _thin(r)]
        if thin:  # off by less than KILL_MARGIN x the bound: no kill, though not a pass either
            verdict.status, verdict.case, verdict.why = "thin", thin[0]["case"], thin[0]["why"]
        bad = next((r for r in rows if r["kind"] in ("mismatch", "crash")), None)
        if bad is not None:
            verdict.case, verdict.why = bad["case"], bad["why"]
            test = next(t for t, c in cases if c == bad["case"]) if bad["case"] != "collection" else ""
            if bad["kind"] == "crash":
                verdict.status = "broken"
            elif (base := self.unplanted(test, bad["case"]))["kind"] != "passed":
                verdict.status, verdict.why = "baseline", base["why"]
            elif not marker.exists():
                verdict.status, verdict.why = "broken", "the planted code never ran"
            else:
                verdict.status, verdict.margin = "killed", bad.get("margin")
        verdict.seconds = time.monotonic() - start
        shutil.rmtree(tree, ignore_errors=True)
        return verdict


def main(argv: list[str]) -> int:
    first = "--first" in argv
    report = argv[argv.index("--report") + 1] if "--report" in argv else None
    names = [a for a in argv if not a.startswith("--") and a != report] or list(PLANTS)
    unknown = [n for n in names if n not in PLANTS]
    if unknown:
        print(f"error: unknown plant {unknown[0]} (NAME): choose from {', '.join(PLANTS)}", file=sys.stderr)
        return 2
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="plants_") as tmp:
        harness = Harness(Path(tmp), first)
        for name in names:
            verdicts.append(harness.judge(name))
            print(verdicts[-1].line(), flush=True)
    killed = sum(v.status == "killed" for v in verdicts)
    print(f"killed {killed} of {len(names)} planted bugs")
    if report:
        Path(report).write_text(json.dumps([v.__dict__ | {"mechanism": PLANTS[v.name].mechanism}
                                            for v in verdicts], indent=1) + "\n")
    return 0 if killed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
