"""Print a layout's rank groups without launching anything: `python -m utils.plan.layout tp=4 dp=2 order=tp-dp`."""

from __future__ import annotations

import sys

from distributed.pipeline.stage_plan import resolve_plan
from utils import ConfigError
from utils.cli.launch import ranks_needed
from utils.comm import Grid, parse_order, resolve_sizes
from utils.schema import ParallelConfig


def main(argv: list[str] | None = None) -> int:
    """`python -m utils.plan.layout tp=4 dp=2 order=tp-dp`: print the rank groups without launching anything.

    With pp > 1, `depth=` (default 4) adds which blocks each stage holds (pp_schedule=,
    pp_stages_per_rank=, pp_microbatches= as in `parallel.`)."""
    args = dict(a.split("=", 1) for a in (argv if argv is not None else sys.argv[1:]))
    text = ("order", "pp_schedule", "cp_attention")
    try:
        cfg = ParallelConfig(**{k: (v if k in text else int(v)) for k, v in args.items()
                                if k not in ("world", "depth")})
        world = int(args.get("world", 0)) or ranks_needed(cfg)
        grid = Grid(resolve_sizes(cfg, world), parse_order(cfg.order))
        plan = resolve_plan(cfg.pp_schedule, cfg.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches,
                            int(args.get("depth", 4))) if cfg.pp > 1 else None
    except (ConfigError, TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(grid.describe())
    if plan is not None:
        print(f"pipeline: {plan.schedule}, {plan.num_stages} stages ({plan.stages_per_rank} per rank), "
              f"{plan.microbatches} microbatches, {plan.bubble_text()}")
        print("\n".join(plan.describe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
