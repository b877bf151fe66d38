"""A newcomer's path: the README's workflow block, every line run in miniature, in its order, from one empty
working folder, so the front door cannot break silently again.

Each README line is taken as written and made small (`miniature`): the same entry point, tool, arguments
and paths (relative to the working folder, as a user types them), with CPU-sized steps, the test's data
(the synthetic ERA5 copy, the WikiText sample) and a Hugging Face folder made here in place of a download.
The sweep runs as a user runs it (`python train.py -m ...`, a process that forks its local ranks), the other
trainings on the rank pool (tests/rank_pool.py), the tools through their `main` in this process. Every line of
the block is run or listed in NOT_RUN with its reason (test_every_workflow_line_is_run_or_listed, fast), so a
new README line needs its miniature here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, make_tokenizer, read_scalars, run_main

README = ROOT / "README.md"
# README lines not run here, by their start: the reason.
NOT_RUN = {
    "python train.py -m parallel=tp4,tp2cp2": "a Slurm launcher (tests/test_sweep.py runs submitit's local launcher)",
    "sbatch": "needs Slurm (tests/test_submit.py runs every script through a stand-in srun; .ci/run's Slurm tier)",
    "python train.py trainer.profile=true": "a profile of steps 5-7 (tests/test_profiling.py profiles tiny runs)",
}
TINY = ["trainer.max_steps=2", "trainer.ckpt_every=2", "trainer.val_every=0", "trainer.val_at_start=false",
        "trainer.global_batch_size=4", "trainer.log_images=false", "data.limit_nsamples_val=4"]
TINY_LM = ["trainer.max_steps=2", "trainer.ckpt_every=2", "trainer.val_every=0", "trainer.val_at_start=false",
           "trainer.global_batch_size=4", "trainer.num_workers=0", "data.seq_len=32", "data.sample_tokens=0",
           "data.limit_eval_tokens=1024"]
# README settings -> their miniature (a value the CPU run affords); others stay as written
SMALLER = {"task.eval.every": "2", "task.eval.steps": "2", "task.rollout_train_steps": "2",
           "task.rollout_train_every": "1", "--steps": "2", "--members": "2", "--world": None}


def workflow() -> list[str]:
    """The README's workflow block: one command per line, continuation lines joined, comments dropped."""
    section = README.read_text().split("## Workflow", 1)[1]
    body = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = re.sub(r"\\\n\s*", " ", body).splitlines()
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines if line.strip()]


def listed(line: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)


def test_every_workflow_line_is_run_or_listed():
    lines = workflow()
    assert len(lines) >= 12 and lines[0].startswith("python train.py -m optim.lr=")
    for line in lines:
        if listed(line) is None:
            assert MINIATURES.get(kind(line)), f"no miniature for the README line {line!r}: add one here"


def kind(line: str) -> str:
    """The miniature a README line gets: its entry point or tool."""
    argv = shlex.split(line)
    if "-m" in argv and not argv[argv.index("-m") + 1].startswith(("optim.", "parallel=")):
        module = argv[argv.index("-m") + 1]
        return module + (f" {argv[argv.index('-m') + 2]}" if module == "utils.export" else "")
    return "sweep" if "-m" in argv else Path(argv[1]).name


def smaller(argv: list[str]) -> list[str]:
    """The README's arguments with CPU-sized values (SMALLER): `key=value` settings and `--flag value` options."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        key = arg.split("=", 1)[0]
        if key in SMALLER and "=" in arg:
            out.append(f"{key}={SMALLER[key]}")
        elif arg in SMALLER:
            skip = True
            if SMALLER[arg] is not None:
                out += [arg, SMALLER[arg]]
        else:
            out.append(arg)
    return out


def absolute(argv: list[str], cwd: Path) -> list[str]:
    """Settings that name a path relative to the working folder, made absolute (rank-pool processes run
    elsewhere)."""
    paths = ("run.dir=", "trainer.init_from=", "data.tokenizer=")
    return [f"{a.split('=', 1)[0]}={cwd / a.split('=', 1)[1]}" if a.startswith(paths) else a for a in argv]


class Newcomer:
    """The working folder a user types the README's lines in, and what the miniatures need."""

    def __init__(self, cwd: Path, era5_root: Path, corpus_root: Path, monkeypatch):
        self.cwd, self.era5_root, self.corpus_root = cwd, era5_root, corpus_root
        self.monkeypatch, self.imported_settings = monkeypatch, None
        cwd.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(cwd)

    def train(self, argv: list[str]) -> None:
        from tests.rank_pool import run_entry_ranks

        results = run_entry_ranks(absolute(argv, self.cwd))
        assert [r.value for r in results] == [0] * len(results), next(
            r.stdout[-1500:] + r.stderr[-3000:] for r in results if r.value)

    def tool(self, module: str, argv: list[str]) -> str:
        code, out, err = run_main(module, *argv)
        assert code == 0, err[-3000:]
        return out + err


def sweep(user: Newcomer, line: str) -> None:
    """The sweep as a user runs it: one process, its local tp2 ranks forked from it after a single point, with
    data workers (the single point starts the forkserver in the sweep's process; the tp2 ranks, forked from it,
    start servers of their own: their waiting for the parent's failed with ChildProcessError,
    utils/data/batching.py)."""
    argv = shlex.split(line)[2:]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv, *TINY, "trainer.num_workers=1",
                           f"data.root={user.era5_root}"], cwd=user.cwd, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = sorted((user.cwd / "outputs").iterdir())
    assert len(runs) == 4 and all((r / "checkpoints" / "latest").is_file() for r in runs), runs


def compare(user: Newcomer, line: str) -> None:
    out = user.tool("utils.compare.report", shlex.split(line)[3:])
    table = (user.cwd / "report" / "compare.md").read_text()
    header = next(row for row in table.splitlines() if row.startswith("| run"))
    assert "optim.lr" in header and "layout" in header, header  # what tells the sweep's points apart
    assert table.count("| tp2 |") == 2 and table.count("| single |") == 2 and "warning" not in out
    assert (user.cwd / "report" / "loss_vs_step.png").is_file()


def train(user: Newcomer, line: str) -> None:
    argv = smaller(shlex.split(line)[2:])
    if "data=wikitext" in argv:  # the LM fine-tune from the imported folder: its shape, the sample corpus
        assert user.imported_settings, "import-hf runs before the fine-tune"
        argv = [a for a in argv if not a.startswith(("model=", "data=", "data.root="))]
        argv = [*user.imported_settings, "data=wikitext_sample", f"data.root={user.corpus_root}", *argv, *TINY_LM]
    else:
        argv = [*argv, *TINY, "trainer.num_workers=0", f"data.root={user.era5_root}"]
    user.train(argv)
    run_dir = user.cwd / next(a.split("=", 1)[1] for a in argv if a.startswith("run.dir="))
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == [1, 2]
    log = (run_dir / "train.log").read_text()
    if "task.rollout_train_steps=2" in argv:  # from the run folder runs/w: its newest step, the curriculum shown
        assert "model weights from " in log and "step_0000002 (trainer.init_from=" in log
        assert " K=1 " in log and " K=2 " in log


def forecast(user: Newcomer, line: str) -> None:
    argv = smaller(shlex.split(line)[3:])
    out = user.tool("utils.forecast.report", [*argv, "--init", "2", f"data.root={user.era5_root}"])
    assert "persistence" in out and "m/s" in out and "spread/skill" in out, out
    assert "units" in (user.cwd / "fc" / "ensemble.md").read_text()


def plan(user: Newcomer, line: str) -> None:
    argv = smaller(shlex.split(line)[3:])
    out = user.tool("utils.plan.cost_model", [*argv, "parallel.tp=8"])
    assert "vocabulary 128256" in out and "tp8" in out, out


def import_hf(user: Newcomer, line: str) -> None:
    """A 'downloaded' Llama folder made here (random weights, a BPE tokenizer), imported as the README says."""
    transformers = pytest.importorskip("transformers")
    folder = user.cwd / shlex.split(line)[4]
    make_tokenizer(folder, user.corpus_root, ["<|end_of_text|>"], eos_token="<|end_of_text|>", vocab_size=300)
    size = max(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"].values()) + 1
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(folder)
    out = user.tool("utils.export.convert", shlex.split(line)[3:])
    settings = re.search(r"python train\.py (.*) data=wikitext_sample data\.tokenizer=", out)
    assert settings and "data.root=" in out, out  # a next command that runs as written, and the own-corpus one
    user.imported_settings = settings.group(1).split()


def generate(user: Newcomer, line: str) -> None:
    argv = shlex.split(line)[3:]
    out = user.tool("utils.generate.command", [*argv, "--max-new-tokens", "6", "--device", "cpu"])
    assert out.startswith("The castle") and "step_0000002" in out  # the run folder's newest step, said


def evaluate(user: Newcomer, line: str) -> None:
    items = [{"context": "The castle", "choices": [" was", " is", " of"], "answer": i % 3} for i in range(4)]
    (user.cwd / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    out = user.tool("utils.evaluate.command", [*shlex.split(line)[3:], "--device", "cpu"])
    assert "accuracy" in out, out


def export_hf(user: Newcomer, line: str) -> None:
    """Exported, the folder loads in transformers with its tokenizer, and greedy text equals utils.generate's."""
    transformers = pytest.importorskip("transformers")
    argv = shlex.split(line)[3:]
    user.tool("utils.export.convert", argv)
    folder = user.cwd / argv[-1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer("The castle", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=6, do_sample=False)[0]
    ours = user.tool("utils.generate.command", [str(folder), "--prompt", "The castle", "--temperature", "0",
                                                "--max-new-tokens", "6", "--device", "cpu"])
    end = theirs.tolist().index(tokenizer.eos_token_id) if tokenizer.eos_token_id in theirs.tolist() else None
    assert ours.splitlines()[0] == tokenizer.decode(theirs[:end]).splitlines()[0]


MINIATURES = {"sweep": sweep, "utils.compare": compare, "train.py": train, "train_mp.py": train,
              "utils.forecast": forecast, "utils.plan": plan, "utils.export import-hf": import_hf,
              "utils.generate": generate, "utils.evaluate": evaluate, "utils.export export-hf": export_hf}


@pytest.mark.slow
def test_the_readme_workflow_runs_as_written(tmp_path, era5_root, corpus_root, monkeypatch):
    user = Newcomer(tmp_path / "work", era5_root, corpus_root, monkeypatch)
    for line in workflow():
        if listed(line) is None:
            MINIATURES[kind(line)](user, line)
