"""The settings that tell compared runs apart (utils/compare/report.py): table columns and the figures' labels.

Read from each run's config.yaml, and its presets.json (the preset chosen per group, written since the command
line records it: utils/checkpoints/run_dir.py): a group whose preset differs between the runs is one column
(`model`: vit_tiny, gpt_tiny) instead of every setting of its sections, when every run recorded its presets (a
setting of those sections still has its column where it differs between runs of one preset). The other settings
that differ are columns of their own (`optim.lr`), the telling ones first (a family key such as `model.arch`,
settings every run has), at most MAX_COLUMNS; the rest are named below the table (an experiment
preset is a column too, beside the settings it changed; the precision preset is the precision column). Left out: the
run.* paths and the settings that change neither what is trained nor how fast (logging and checkpoint cadence,
timeouts, data paths: utils/checkpoints/run_dir.py RESUME_SAFE); a layout's settings (parallel.*), compile,
activation checkpointing, accumulation and workers are shown, the axis sizes and order as the layout column
already shows them, the precision mode as the precision column does.

A run's label, its name in the figures' legends, is what tells it apart: the differing presets, layout and
precision and at most LABEL_SETTINGS settings, `optim.lr=0.0005`; its name when that says nothing or when two runs
would get the same label.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_COLUMNS = 6
LABEL_SETTINGS = 3
SHOWN_ANYWAY = ("parallel.", "precision.compile", "trainer.activation_checkpointing", "trainer.grad_accum_steps",
                "trainer.num_workers", "trainer.worker_start", "trainer.ckpt_async")  # they change speed or memory
OWN_COLUMNS = ("parallel.tp", "parallel.cp", "parallel.dp", "parallel.pp", "parallel.order",  # the layout column
               "precision.mode")  # the precision column
MISSING = object()


@dataclass
class Settings:
    """The settings that differ between the runs compared, in the runs' order."""

    columns: list[str]  # table columns: a preset group ('model') or a setting ('optim.lr')
    values: list[dict[str, str]]  # per run: column -> the value shown ('' where the run has no such setting)
    labels: list[str]  # per run: its label in the figures
    more: list[str]  # other settings that differ, without a column


def ignored(key: str) -> bool:
    from utils.checkpoints.run_dir import RESUME_SAFE

    return key in OWN_COLUMNS or (key.startswith(RESUME_SAFE) and not key.startswith(SHOWN_ANYWAY))


def compare_settings(configs: list[dict[str, object]], presets: list[dict | None], layouts: list[str],
                     precisions: list[str], names: list[str]) -> Settings:
    """`configs`: each run's flat config (utils.checkpoints.run_dir.flat_config), `presets` its presets.json (None
    without one); `layouts`, `precisions`, `names` as the table shows them."""
    from utils.checkpoints.run_dir import IDENTITY_KEYS, PRESET_SECTIONS, shown_value

    def differs(values: list) -> bool:
        return any(v != values[0] for v in values[1:])

    groups = [g for g in PRESET_SECTIONS if g != "precision" and all(p is not None for p in presets)
              and differs([p.get(g) for p in presets])]
    covered = {section: g for g in groups for section in PRESET_SECTIONS[g]}

    def within_presets(key: str) -> bool:
        """Whether `key` differs between runs that chose the same preset of the group its column stands for."""
        group, same = covered.get(key.split(".")[0]), {}
        if group is None:
            return True
        for preset, config in zip(presets, configs):
            same.setdefault(preset.get(group), []).append(config.get(key, MISSING))
        return any(differs(values) for values in same.values())

    keys = [k for k in sorted(set().union(*configs)) if not ignored(k) and within_presets(k)
            and differs([c.get(k, MISSING) for c in configs])]
    keys.sort(key=lambda k: (k.rsplit(".", 1)[-1] not in IDENTITY_KEYS, any(k not in c for c in configs)))
    shown, more = keys[:MAX_COLUMNS - len(groups)], keys[MAX_COLUMNS - len(groups):]
    values = [{**{g: str(p.get(g)) for g in groups},
               **{k: "" if k not in c else shown_value(c[k], 24) for k in shown}} for p, c in zip(presets, configs)]
    labels = []
    for i, row in enumerate(values):
        parts = [f"{g}={row[g]}" for g in groups]
        parts += [what[i] for what in (layouts, precisions) if differs(what)]
        parts += [f"{k}={row[k] or 'none'}" for k in shown[:LABEL_SETTINGS]]
        labels.append(", ".join(parts) + (", ..." if len(shown) > LABEL_SETTINGS else ""))
    if not all(labels) or len(set(labels)) < len(labels):
        labels = list(names)
    return Settings(groups + shown, values, labels, more)


def more_note(settings: Settings, shown: int = 8) -> str:
    """The line below the table that names the differing settings without a column ('' when there are none)."""
    if not settings.more:
        return ""
    rest = len(settings.more) - shown
    return ("other settings that differ between the runs: " + ", ".join(settings.more[:shown])
            + (f" and {rest} more" if rest > 0 else "") + " (each run's config.yaml)")
