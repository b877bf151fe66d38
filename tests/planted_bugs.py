"""Prove the combination matrix by breaking things: `python -m tests.planted_bugs [NAME ...] [--first]`.

Each plant is a realistic defect of combination code, written as one text edit. For each, the tree is
copied to a temporary folder, the edit applied there (it must match exactly once, so a plant that no
longer fits the code fails loudly instead of testing nothing), and the matrix's accepted cases
(tests/test_matrix.py) run on the copy; a plant is killed when at least one case fails. Prints a line per
plant (failed / run cases) and the kill count. `--first` stops each run at its first failure (faster).
Not part of the suite: it runs the matrix once per plant.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLANTS = {  # name -> (what the defect does, [(file, text in the fixed code, the defect's text), ...])
    "fsdp_pp_bf16_dtype": (
        "issue 23 item 1: FSDP2's bf16 policy casts block inputs, so a stage's output is bf16, unchecked",
        [("distributed/fsdp.py", "policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)",
          "policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \\\n"
          "        if precision == 'bf16' else MixedPrecisionPolicy()"),
         ("distributed/pipeline/stages.py", "if x.dtype != self.activation_dtype or tuple(x.shape) != shape:",
          "if tuple(x.shape) != shape:")]),
    "ring_scores_under_autocast": (
        "issue 23 item 2: the ring's scores, row max, sums and LSE follow autocast (bf16)",
        [("distributed/context/ring.py", "with torch.autocast(q.device.type, enabled=False):",
          "with contextlib.nullcontext():"),
         ("distributed/context/ring.py", "\nimport torch\n", "\nimport contextlib\n\nimport torch\n")]),
    "checkpoint_wrapper_names": (
        "issue 23 item 3: Adam state named from named_parameters(), wrapper prefixes included",
        [("utils/checkpoints/sharded_state.py", "    params = parameter_names(model)\n",
          "    params = dict(model.named_parameters(remove_duplicate=False))\n")]),
    "ddp_divides_by_dp_x_cp": (
        "DDP's hook divides the gradients summed over dp x cp by the group size (dp x cp), not by dp",
        [("distributed/data_parallel.py", "ddp.register_comm_hook((axis, grid.batch.size)",
          "ddp.register_comm_hook((axis, axis.size)")]),
    "pipeline_loss_ignores_accumulation": (
        "the pipeline divides each microbatch loss by the microbatches of one accumulation step only",
        [("distributed/pipeline/schedule.py", "self.divisor, self.scale = accum * self.plan.microbatches, scale",
          "self.divisor, self.scale = self.plan.microbatches, scale")]),
    "partial_grads_skip_vectors": (
        "the sum of partial gradients over tp skips 1-D parameters (sequence-parallel norms, row biases)",
        [("distributed/data_parallel.py", "        sum_grads(params, axis)\n",
          "        sum_grads([p for p in params if p.dim() > 1], axis)\n")]),
}


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones) into `dest`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def plant(tree: Path, edits: list[tuple[str, str, str]]) -> None:
    for file, old, new in edits:
        path = tree / file
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"error: the plant's text occurs {text.count(old)} times in {file}, not once: "
                             "update PLANTS")
        path.write_text(text.replace(old, new))


def run_matrix(tree: Path, first: bool) -> tuple[int, int, str]:
    """(failed, run, pytest's last line) of the matrix's accepted cases on `tree`."""
    args = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_matrix.py",
            "-k", "accepted", *(["-x"] if first else [])]
    proc = subprocess.run(args, cwd=tree, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|error)", last)}
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return failed, failed + counts.get("passed", 0), last


def main(argv: list[str]) -> int:
    first = "--first" in argv
    names = [a for a in argv if not a.startswith("--")] or list(PLANTS)
    unknown = [n for n in names if n not in PLANTS]
    if unknown:
        print(f"error: unknown plant {unknown[0]} (NAME): choose from {', '.join(PLANTS)}", file=sys.stderr)
        return 2
    killed = 0
    for name in names:
        what, edits = PLANTS[name]
        with tempfile.TemporaryDirectory(prefix=f"plant_{name}_") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            plant(tree, edits)
            failed, run, last = run_matrix(tree, first)
        killed += failed > 0
        print(f"{name}: {'KILLED' if failed else 'SURVIVED'} ({failed} of {run} cases failed; {what})", flush=True)
    print(f"killed {killed} of {len(names)} planted bugs")
    return 0 if killed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
