"""Pipeline plans: which schedule, how many stages, which rank and which blocks each stage gets.

Pure arithmetic on the settings (no processes), shared by the config checks, the layout command and
the stage builder (`distributed/pipeline/stages.py`):
- `SCHEDULES` (utils/schema.py: the choices of parallel.pp_schedule): our names of torch.distributed.pipelining's
  schedules, their class and their placement style: one stage per rank ('single'), v stages per rank in a loop
  (stage s on pp rank s % p), or two stages per rank in a V (rank r holds stages r and 2p-1-r, so the first and
  last stage share rank 0);
- `block_split(depth, stages)`: contiguous blocks per stage; when depth is not a multiple of the stage
  count, the first depth % stages stages hold one block more (the stated rule for uneven splits);
- `check_pipeline`: the settings torch's schedules would reject, as one-line errors before any work;
- `bubble_fraction(p, m, v)`: the idle fraction of a step the schedule theory predicts (GPipe, 1F1B,
  looped and interleaved; the zero-bubble schedules have none in closed form).
"""

from __future__ import annotations

from dataclasses import dataclass

from utils import require
from utils.schema import SCHEDULES, SPLIT_BACKWARD  # the choices of parallel.pp_schedule


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline of one run: p ranks, v stages per rank, m microbatches per pipeline step."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    depth: int

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][1]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs `stage`."""
        if self.style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pp rank `pp_rank` runs, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank]

    def blocks_of(self, stage: int) -> range:
        """Indices of the blocks `stage` holds."""
        return block_split(self.depth, self.num_stages)[stage]

    def bubble(self) -> float | None:
        """The theory's idle fraction; None for the zero-bubble schedules (no closed form: about zero
        when forward, input-gradient and weight-gradient times are equal)."""
        if self.schedule in SPLIT_BACKWARD:
            return None
        return bubble_fraction(self.pp, self.microbatches, self.stages_per_rank)

    def bubble_text(self) -> str:
        bubble = self.bubble()
        if bubble is None:
            return "bubble ~0 in theory (zero-bubble schedule, when forward, input- and weight-gradient times match)"
        return f"bubble (p-1)/(v*m+p-1) = {bubble:.3f}"

    def describe(self) -> list[str]:
        """One line per pp rank: its stages and their blocks."""
        lines = []
        for r in range(self.pp):
            parts = []
            for s in self.stages_of(r):
                blocks = self.blocks_of(s)
                ends = (["embedding"] if s == 0 else []) + (["head"] if s == self.num_stages - 1 else [])
                held = f"block {blocks.start}" if len(blocks) == 1 else f"blocks {blocks.start}-{blocks.stop - 1}"
                parts.append(f"stage {s}: {held}" + "".join(f" + {e}" for e in ends))
            lines.append(f"  pp rank {r}: " + "; ".join(parts))
        return lines


def block_split(depth: int, stages: int) -> list[range]:
    """Contiguous blocks per stage; the first depth % stages stages hold one block more."""
    base, extra = divmod(depth, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + base + (s < extra)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1) for one stage per rank; (p-1)/(v*m+p-1) with v stages per
    rank (the interleaved schedule's (p-1)/(v*m) bubble relative to the compute, as a fraction of the step)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def resolve_plan(schedule: str, pp: int, stages_per_rank: int, microbatches: int, depth: int) -> PipelinePlan:
    """The plan for these settings (0 = default for stages per rank and microbatches), checked."""
    require(schedule in SCHEDULES, f"unknown pipeline schedule {schedule!r}", "parallel.pp_schedule",
            "choose one of " + ", ".join(SCHEDULES))
    style = SCHEDULES[schedule][1]
    v = stages_per_rank or (1 if style == "single" else 2)
    plan = PipelinePlan(schedule, pp, v, microbatches or pp * v, depth)
    check_pipeline(plan)
    return plan


def check_pipeline(plan: PipelinePlan) -> None:
    """One-line errors for plans the schedules cannot run (torch would fail later, on some ranks)."""
    name, style, v, m, stages = plan.schedule, plan.style, plan.stages_per_rank, plan.microbatches, plan.num_stages
    require(style != "single" or v == 1, f"pp_schedule={name} runs one stage per rank, got pp_stages_per_rank={v}",
            "parallel.pp_stages_per_rank", "set it to 1 (or 0), or use interleaved_1f1b/looped_bfs for more")
    require(style != "v" or v == 2, f"pp_schedule={name} places exactly two stages per rank (a V), got {v}",
            "parallel.pp_stages_per_rank", "set it to 2 (or 0)")
    require(m >= 1, f"pp_microbatches must be positive, got {m}", "parallel.pp_microbatches", "set 0 (default) or more")
    require(stages <= plan.depth, f"{stages} pipeline stages (pp={plan.pp} x {v} per rank) for {plan.depth} blocks",
            "parallel.pp", f"use at most {plan.depth} stages, or a deeper model.depth")
    if name in ("1f1b", "dualpipev"):  # torch's own checks; zbv pads its schedule to any m
        require(m >= stages, f"pp_schedule={name} needs at least {stages} microbatches (one per stage), got {m}",
                "parallel.pp_microbatches", f"set parallel.pp_microbatches >= {stages}")
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // plan.pp)
        require(m % rounds == 0, f"pp_schedule={name} runs microbatches in rounds of pp={plan.pp}: {m} is not a "
                f"multiple of its {rounds} rounds", "parallel.pp_microbatches",
                f"use a multiple of pp={plan.pp} (or fewer than {plan.pp})")
