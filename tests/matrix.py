"""The space of layouts the config accepts, and an all-pairs covering set of it: the combination matrix.

A case sets the factors of FACTORS. A factor that does not act in a case is inactive and set to None (the
schedule without pp, cp_attention without cp, cp_a2a without the hierarchical variant, sequence
parallelism without tp, packing with the ViT, dp_mode without a dp x cp group to shard over, the order with
fewer than two axes above 1), so the space holds each distinct run once. cp=4 is in the space for the
hierarchical variant (which needs two groups of cp_a2a=2), the other variants run at cp=4 in
tests/test_cp_variants.py.
Whether a case is accepted is decided by the trainer's own checks, run without launching anything: the
typed config's validation (`Config.__post_init__`, via `dataclasses.replace` on a config composed once
per model), the grid check against the world size, and the batch check (`build_run` makes the same three
before any work). A refused case carries that one-line error.

`covering_set()` (cached in tests/data/matrix_cases.json, recomputed when the code or configs change): every
pair of (factor, value) settings that occurs together in some accepted case occurs in at least one accepted
case of the set (greedy all-pairs: each pick covers the most pairs still
uncovered, the cheaper case first among equals), and every pair that occurs only in refused cases gets
one refused case, whose refusal the matrix then checks, unless every case holding it holds a more general
such pair (`_causes`: hierarchical with pp=2 is refused because hierarchical at cp=2 is); and each REQUIRED
combination of more than two settings is held by some accepted case.
`random_cases(seed, n)` draws accepted cases for longer runs outside the default suite (`pytest
--matrix-seed S --matrix-cases N`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.helpers import NARROW, TINY_GPT
from utils import ConfigError
from utils.tasks.registry import BUILT_IN

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
MAX_WORLD = 4
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "tests" / "data" / "matrix_cases.json"  # the covering set, with the fingerprint it was made from
SOURCES = ("config", "distributed", "networks", "utils", "tests/matrix.py", "tests/helpers.py")
FACTORS = {
    # the registry's built-in families (the folders of networks/), each run with its MODEL_ARGS, in the order the
    # covering set was made in (a new family comes last, with settings derived from its spec: `MODEL_ARGS`)
    "model": tuple(sorted(BUILT_IN, key=lambda arch: ("vit", "gpt", "llama", arch).index(arch))),
    "tp": (1, 2),
    "cp": (1, 2, 4),
    "pp": (1, 2, 4),
    "dp": (1, 2, 4),  # with tp, cp, pp: every world of 2 to MAX_WORLD ranks
    "order": ("tp-cp-dp-pp", "pp-dp-cp-tp"),  # nearest ranks first: the default, and its reverse
    "dp_mode": ("ddp", "fsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "schedule": SCHEDULES,
    "cp_attention": ("allgather", "ring", "alltoall", "hierarchical"),
    "cp_a2a": (2, 3),  # hierarchical's all-to-all group: 2 divides cp=4 into two groups; 3 divides no cp
    "sequence_parallel": (True, False),
    "activation_checkpointing": (False, True),
    "grad_accum_steps": (1, 2),
    "packing": ("concat", "documents"),  # the language models' rows: one stream, or whole documents masked apart
}
NAMES = tuple(FACTORS)
# Settings that must run together though no pair guarantees it: each is held by a chosen case (the cheapest
# accepted one that has it, added after the all-pairs picks when none of them does). Where gradient accumulation
# syncs matters in fp32 at pp=1, where the curves see a micro-batch synced alone, under both dp modes (DDP decides
# in forward, FSDP2 in its post-backward hook: distributed/data_parallel.py `no_sync`).
REQUIRED = ({"pp": 1, "dp_mode": "ddp", "precision": "fp32", "grad_accum_steps": 2},
            {"pp": 1, "dp_mode": "fsdp", "precision": "fp32", "grad_accum_steps": 2})
GLOBAL_BATCH = 16  # divisible by every dp x accumulation x microbatches of the space
# Each case validates once, at its end: the language models on 512 tokens (one batch of 16 rows of 32), about 8%
# of a case's CPU less than 2048 (docs/measurements.md), the ViT on 8 samples (half a batch).
TUNED_ARGS = {
    "vit": ["trainer.global_batch_size=16", "data.limit_nsamples_val=8", "model.depth=4", *NARROW],
    "gpt": [*TINY_GPT, "data.limit_eval_tokens=512", "trainer.global_batch_size=16", *NARROW],
    "llama": ["model=llama_tiny", *TINY_GPT[1:], "data.limit_eval_tokens=512", "trainer.global_batch_size=16",
              *NARROW],
}
# A built-in family without tuned settings runs on its smallest preset (`ModelSpec.tiny`) and the first data
# preset of its task, cut as the tuned ones are: a new family folder of networks/ joins the matrix unedited.
TASK_ARGS = {"wikitext": [*TINY_GPT[1:], "data.limit_eval_tokens=512"], "era5": ["data.limit_nsamples_val=8"]}


def _derived_args(arch: str) -> list[str]:
    from utils.tasks import task_of
    from utils.tasks.registry import spec_of

    spec = spec_of(arch)
    task = task_of(spec)
    kind = task.DATA_KIND
    data = [] if any(a.startswith("data=") for a in TASK_ARGS.get(kind, [])) else [f"data={task.DATA_PRESETS[kind][0]}"]
    return [f"model={spec.tiny}", *data, *TASK_ARGS.get(kind, []), "trainer.global_batch_size=16", *NARROW]


MODEL_ARGS = {arch: TUNED_ARGS.get(arch) or _derived_args(arch) for arch in FACTORS["model"]}


class Mismatch(AssertionError):
    """A matrix comparison failed: the case ran and trained (or refused) something other than predicted, as
    opposed to a crash (tests/planted_bugs.py counts only these as kills). `margin`: how many times its bound the
    value is off (inf for a categorical difference: a checkpoint key, an exit status, a refusal line)."""

    def __init__(self, message: str, margin: float = math.inf):
        super().__init__(message)
        self.margin = margin


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    cp: int
    pp: int
    dp: int
    order: str | None
    dp_mode: str | None
    precision: str
    schedule: str | None
    cp_attention: str | None
    cp_a2a: int | None
    sequence_parallel: bool | None
    activation_checkpointing: bool
    grad_accum_steps: int
    packing: str | None = None  # None for the ViT (no documents)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return self.tp, self.cp, self.pp, self.dp

    @property
    def layout(self) -> str:
        return "".join(f"{axis}{size}" for axis, size in zip(("tp", "cp", "pp", "dp"), self.sizes) if size > 1)

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    @property
    def name(self) -> str:
        parts = [self.model, self.layout, self.precision]
        optional = {"order": self.order and f"o{self.order.replace('-', '')}", "dp_mode": self.dp_mode,
                    "schedule": self.schedule, "cp_attention": self.cp_attention,
                    "cp_a2a": self.cp_a2a and f"a2a{self.cp_a2a}",
                    "sequence_parallel": self.sequence_parallel is not None and f"sp{int(self.sequence_parallel)}"}
        parts += [v for v in optional.values() if v]
        parts += ["ac" if self.activation_checkpointing else "", f"acc{self.grad_accum_steps}",
                  "docs" if self.packing == "documents" else ""]
        return "-".join(p for p in parts if p)

    def overrides(self) -> list[str]:
        """The command-line settings of the case, beyond MODEL_ARGS."""
        tp, cp, pp, dp = self.sizes
        args = [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                f"precision={self.precision}", f"trainer.grad_accum_steps={self.grad_accum_steps}",
                f"trainer.activation_checkpointing={str(self.activation_checkpointing).lower()}"]
        optional = {"order": "parallel.order", "dp_mode": "parallel.dp_mode", "schedule": "parallel.pp_schedule",
                    "cp_attention": "parallel.cp_attention",
                    "cp_a2a": "parallel.cp_a2a", "sequence_parallel": "parallel.sequence_parallel"}
        for field, key in optional.items():
            value = getattr(self, field)
            if value is not None:
                args.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        return args + packing_args(self.packing)

    def settings(self) -> tuple[tuple[str, object], ...]:
        return tuple((n, getattr(self, n)) for n in NAMES if getattr(self, n) is not None)


def packing_args(packing: str | None) -> list[str]:
    """The settings of a `packing` factor value: whole documents come with per-document attention."""
    return ["data.packing=documents", "data.attention=document"] if packing == "documents" else []


def _acting(tp: int, cp: int, pp: int, dp: int) -> dict[str, bool]:
    """Which of the factors that can be inactive act in a layout (cp_a2a only with cp_attention=hierarchical)."""
    return {"order": sum(s > 1 for s in (tp, cp, pp, dp)) >= 2, "dp_mode": dp * cp > 1, "schedule": pp > 1,
            "cp_attention": cp > 1, "cp_a2a": cp > 1, "sequence_parallel": tp > 1}


def normalize(values: dict) -> Case | None:
    """The case of these factor values with every inactive factor set to None (None: not 2..MAX_WORLD ranks,
    or cp=4 without the hierarchical variant: the space has cp=4 for it, tests/test_cp_variants.py runs the
    others at cp=4)."""
    tp, cp, pp, dp = (values[axis] for axis in ("tp", "cp", "pp", "dp"))
    if not 2 <= tp * cp * pp * dp <= MAX_WORLD or (cp == 4 and values["cp_attention"] != "hierarchical"):
        return None
    active = _acting(tp, cp, pp, dp)
    active["cp_a2a"] = active["cp_a2a"] and values["cp_attention"] == "hierarchical"
    active["packing"] = _reads_documents(values["model"])
    return Case(**{n: (values[n] if active.get(n, True) else None) for n in NAMES})


@cache
def _reads_documents(arch: str) -> bool:
    """Whether the family reads packed documents (`ModelSpec.documents`): the packing factor acts on it."""
    from utils.tasks.registry import spec_of

    return spec_of(arch).documents


@cache
def space() -> tuple[Case, ...]:
    """Every distinct case of the factors (for each layout, the product of the factors acting in it)."""
    axes = ("tp", "cp", "pp", "dp")
    cases = set()
    for sizes in itertools.product(*(FACTORS[a] for a in axes)):
        acting = _acting(*sizes)
        free = [n for n in NAMES if n not in axes and acting.get(n, True)]
        for values in itertools.product(*(FACTORS[n] for n in free)):
            cases.add(normalize({**dict.fromkeys(NAMES), **dict(zip(axes, sizes)), **dict(zip(free, values))}))
    cases.discard(None)
    return tuple(sorted(cases, key=lambda c: c.name))


@cache
def _base_configs():
    from utils.cli.config import load_config

    return {model: load_config(args)[0] for model, args in MODEL_ARGS.items()}


@cache
def refusal(case: Case) -> str | None:
    """The one-line error the trainer refuses the case with before any work, or None if it accepts it."""
    from distributed.pipeline.stage_plan import resolve_plan
    from utils.comm import check_grid
    from utils.data.batching import check_batch
    from utils.launch_env import LaunchEnv

    base = _base_configs()[case.model]
    tp, cp, pp, dp = case.sizes
    par = dict(tp=tp, cp=cp, pp=pp, dp=dp, order=case.order or base.parallel.order,
               dp_mode=case.dp_mode or "ddp", pp_schedule=case.schedule or base.parallel.pp_schedule,
               cp_attention=case.cp_attention or base.parallel.cp_attention, cp_a2a=case.cp_a2a or base.parallel.cp_a2a,
               sequence_parallel=True if case.sequence_parallel is None else case.sequence_parallel)
    try:
        cfg = dataclasses.replace(
            base, parallel=dataclasses.replace(base.parallel, **par),
            precision=dataclasses.replace(base.precision, mode=case.precision),
            trainer=dataclasses.replace(base.trainer, grad_accum_steps=case.grad_accum_steps,
                                        activation_checkpointing=case.activation_checkpointing),
            data=base.data if case.packing is None else dataclasses.replace(
                base.data, packing=case.packing, attention="document" if case.packing == "documents" else "causal"))
        check_grid(cfg.parallel, LaunchEnv(world_size=case.world))
        p = cfg.parallel
        microbatches = resolve_plan(p.pp_schedule, pp, p.pp_stages_per_rank, p.pp_microbatches,
                                    cfg.model.depth).microbatches if pp > 1 else 1
        # the data's size is no factor of the space (every case reads the same data): only the split is checked
        check_batch(cfg.trainer.global_batch_size, dp, cfg.trainer.grad_accum_steps, GLOBAL_BATCH, microbatches)
    except ConfigError as err:
        return str(err)
    return None


def _pairs(case: Case) -> list[tuple]:
    return list(itertools.combinations(case.settings(), 2))


def _masks(cases: list[Case]) -> tuple[dict[Case, int], list[tuple]]:
    """Each case's pairs as a bit mask over an index of every pair (set arithmetic on ints is fast)."""
    index: dict[tuple, int] = {}
    masks = {}
    for case in cases:
        mask = 0
        for pair in _pairs(case):
            mask |= 1 << index.setdefault(pair, len(index))
        masks[case] = mask
    return masks, list(index)


def _cost(case: Case) -> tuple:
    return (case.world, case.grad_accum_steps, case.name)


def fingerprint() -> str:
    """A digest of everything a case's verdict can depend on: the configs, the code below the command line
    and this module (its factors and models)."""
    digest = hashlib.sha256()
    for source in SOURCES:
        path = ROOT / source
        for file in sorted([path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.yaml")]):
            digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


@cache
def covering_set() -> tuple[tuple[Case, ...], tuple[tuple[Case, str], ...]]:
    """`compute_covering_set()`, read from CACHE when its fingerprint is the tree's, else computed and written
    there (so a collection costs a read, not the 10728 verdicts: about 9 s of CPU per pytest worker)."""
    current = fingerprint()
    try:
        saved = json.loads(CACHE.read_text())
        # DLSCALE_MATRIX_FROZEN (the plant harness, tests/planted_bugs.py): the set as cached, whatever the tree
        if saved["fingerprint"] == current or os.environ.get("DLSCALE_MATRIX_FROZEN"):
            return (tuple(Case(**c) for c in saved["accepted"]),
                    tuple((Case(**c), why) for c, why in saved["refused"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    accepted, refused = compute_covering_set()
    data = {"fingerprint": current, "accepted": [dataclasses.asdict(c) for c in accepted],
            "refused": [(dataclasses.asdict(c), why) for c, why in refused]}
    partial = CACHE.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(data, indent=0) + "\n")
        partial.replace(CACHE)  # atomic: pytest workers may write it at once
    except OSError:  # a read-only checkout: the set is computed, the next collection computes it again
        partial.unlink(missing_ok=True)
    return accepted, refused


def compute_covering_set() -> tuple[tuple[Case, ...], tuple[tuple[Case, str], ...]]:
    """(accepted cases covering every pair that an accepted case has, refused cases with their errors
    covering the pairs only refused cases have)."""
    verdicts = {case: refusal(case) for case in space()}
    accepted = sorted((c for c, why in verdicts.items() if why is None), key=_cost)
    masks, index = _masks(accepted)
    uncovered = 0
    for mask in masks.values():
        uncovered |= mask
    chosen = []
    while uncovered:
        best = max(accepted, key=lambda c: (masks[c] & uncovered).bit_count())  # the cheapest among equals
        chosen.append(best)
        uncovered &= ~masks[best]
    for spec in REQUIRED:  # accepted is sorted cheapest first
        if not any(holds(c, spec) for c in chosen):
            chosen.append(next(c for c in accepted if holds(c, spec)))
    causes = _causes(sorted((c for c, why in verdicts.items() if why is not None), key=_cost), set(index))
    refused = []
    for case in sorted((c for c, why in verdicts.items() if why is not None), key=_cost):
        if new := set(_pairs(case)) & causes:
            refused.append((case, verdicts[case]))
            causes -= new
    return tuple(chosen), tuple(refused)


def holds(case: Case, spec: dict) -> bool:
    """Whether `case` has every setting of `spec` (a REQUIRED entry)."""
    return all(getattr(case, name) == value for name, value in spec.items())


def _causes(refused: list[Case], accepted_pairs: set) -> set:
    """The pairs only refused cases have, less those whose every case also holds a more general such pair
    (a pair held by a superset of its cases: hierarchical with pp=2 is refused because hierarchical at cp=2
    is, every case of the one being a case of the other), which a refused case of the general pair explains."""
    masks, index = _masks(refused)
    holders: dict[tuple, int] = {}
    for bit, case in enumerate(refused):
        for pair in _pairs(case):
            holders[pair] = holders.get(pair, 0) | 1 << bit
    only = sorted((p for p in holders if p not in accepted_pairs), key=lambda p: (-holders[p].bit_count(), str(p)))
    roots: list[tuple] = []
    for pair in only:  # the most general first: a pair is implied when a root's cases include all of its own
        if not any(holders[pair] & ~holders[root] == 0 for root in roots):
            roots.append(pair)
    return set(roots)


def random_cases(seed: int, count: int) -> list[Case]:
    """`count` accepted cases drawn at random (seeded) from the whole space."""
    rng = random.Random(seed)
    cases = list(space())
    rng.shuffle(cases)
    return [case for case in cases if refusal(case) is None][:count]
