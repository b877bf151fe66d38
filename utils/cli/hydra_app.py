"""Hydra's own command line for train.py: multirun sweeps and launchers, --cfg job|hydra|all, --info, hydra.*.

train.py (utils/cli/entry.py) sends here only the command lines that need Hydra's app
(`is_hydra_command`): -m/--multirun, --info, --cfg followed by job|hydra|all, hydra.* or hydra/* settings,
-cn/-cp/-cd. A plain run keeps its
fast path (load_config). Before Hydra starts, every point of a sweep is composed and validated like a
single run, so a bad value stops the sweep with the one-line error and exit 2 before any point trains.

Each point runs `task` (module level: the submitit launchers pickle it), which converts the config
Hydra composed with the same `typed_config` as a single run and trains it with `run` (utils/cli/local_launch.py):
- run.dir: the point's usual name under run.root (its overrides give it the digest the same single run
  gets), unless hydra.run.dir=DIR or hydra.sweep.dir=DIR was given: then Hydra's job folder (DIR, or
  DIR/<hydra.sweep.subdir>, by default DIR/<job number>) is the run.dir. An explicit run.dir wins.
- ranks: one process for a layout of several ranks starts them (utils/cli/local_launch.py), as a single run does;
  under a submitit launcher with several tasks per point (hydra.launcher.tasks_per_node, nodes), each
  task is one rank: torch.distributed's variables come from submitit's view of the Slurm (or local) job.
The basic launcher runs the points one after another and stops at the first that fails, with its exit
status. Under a submitit launcher (`record_submitit_stops`, `end_submitit_point` below):
- a point whose layout does not fit hydra.launcher.nodes x tasks_per_node is refused before any job is
  submitted (the one-line error, exit 2);
- the trainer's stop is submitit's checkpoint: its time-limit signal (SIGUSR2, `signal_delay_s` ahead) and
  Slurm's SIGTERM/SIGUSR1 make every rank finish its step, checkpoint and end with 75, and then submitit's
  own handler requeues the job (hydra.launcher.max_num_timeout times for time limits: 3 unless set, as
  submitit's own default; Hydra's plugin would say 0), which resumes from that checkpoint;
- a point that fails, or stops without being requeued, is a FAILED Slurm job with its exit status, and the
  sweep reports its error (its .submitit log has the rest).
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import NoReturn

from utils import EXIT_BAD_INPUT, ConfigError, exit_bad_input
from utils.engine.preemption import EXIT_PREEMPTED, record_stop_signals

ROOT = Path(__file__).resolve().parents[2]
# Hydra's flags that make a command Hydra's (its argparse spelling); --cfg/-c only with a kind after it.
HYDRA_FLAGS = ("-m", "--multirun", "--info", "-i", "-cn", "--config-name", "-cp", "--config-path", "-cd",
               "--config-dir", "--hydra-help", "--version", "-r", "--run", "-sc", "--shell-completion")
CFG_KINDS = ("job", "hydra", "all")
# Requeues of a sweep point at its time limit: submitit's own default (Hydra's plugin says 0: never requeued)
SUBMITIT_MAX_NUM_TIMEOUT = 3


def is_hydra_command(argv: list[str]) -> bool:
    """Whether this command line needs Hydra's app rather than the single-run fast path."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in HYDRA_FLAGS or arg.lstrip("+~").startswith(("hydra.", "hydra/")):
            return True
        if flag in ("--cfg", "-c") and (value or (argv[i + 1] if i + 1 < len(argv) else "")) in CFG_KINDS:
            return True
    return False


def _is_hydra_key(override: str) -> bool:
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


def _given(overrides, key: str) -> bool:
    """Whether the command line sets `key` (hydra.run.dir, hydra.sweep.dir, ...)."""
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def with_sweep_subdir(argv: list[str], overrides: list[str]) -> list[str]:
    """hydra.sweep.dir=DIR without a subdir: the points go to DIR/<job number> (Hydra's default), not to
    DIR itself (config.yaml's subdir `.` keeps Hydra from making folders when no sweep dir is chosen)."""
    if not _given(overrides, "hydra.sweep.dir") or _given(overrides, "hydra.sweep.subdir"):
        return argv
    end = next(i + len(overrides) for i in range(len(argv)) if argv[i:i + len(overrides)] == overrides)
    return [*argv[:end], "hydra.sweep.subdir=${hydra.job.num}", *argv[end:]]


def check_points(overrides: list[str], multirun: bool) -> str | None:
    """Compose and validate every point as a single run (ConfigError at the first bad one), and the run
    directories of a sweep's points; the sweep's run.root (None when another sweeper chooses the points: Hydra
    validates those)."""
    from utils.cli.config import load_config, sweep_points

    hydra_args = [o for o in overrides if _is_hydra_key(o)]
    task_args = [o for o in overrides if not _is_hydra_key(o)]
    if multirun and (_given(hydra_args, "hydra/sweeper") or any(o.startswith("hydra.sweeper.") for o in hydra_args)):
        return None
    points = sweep_points(task_args) if multirun else [task_args]
    loaded = [load_config((hydra_args if i == 0 else []) + point) for i, point in enumerate(points)]
    cfgs = [cfg for cfg, _, _ in loaded]
    if multirun:
        check_launcher_ranks(hydra_args, points, cfgs)
        check_point_run_dirs(hydra_args, points, loaded)
    return cfgs[0].run.root


def _point(num: int, point: list[str]) -> str:
    return f"#{num} ({' '.join(point) or 'no overrides'})"


def check_point_run_dirs(hydra_args: list[str], points: list[list[str]], loaded: list[tuple]) -> None:
    """Before any point trains: refuse two points that would train in one run directory with other settings
    (the second would refuse the first's checkpoints, or continue them), and a point whose run directory holds
    checkpoints of other settings. A point in Hydra's job folder (hydra.sweep.dir, no run.dir) has its own."""
    from utils.checkpoints.run_dir import changed_settings, summary
    from utils.cli.launch import ranks_needed
    from utils.cli.runs import check_run_dir, run_digest
    from utils.launch_env import launch_env

    world, single = _launcher_world(hydra_args), launch_env().source == "single"
    seen: dict[str, int] = {}
    for num, (point, (cfg, choices, config_yaml)) in enumerate(zip(points, loaded)):
        if cfg.run.dir is None and _given(hydra_args, "hydra.sweep.dir"):
            continue
        ranks = world or (ranks_needed(cfg.parallel) if single else None)  # None: this launch's (torchrun's)
        try:
            run_dir = check_run_dir(cfg, choices, config_yaml, run_digest(cfg, choices, config_yaml), ranks)
        except ConfigError as err:
            raise ConfigError(f"sweep point {_point(num, point)}: {err.what}", err.setting, err.fix) from None
        first = seen.setdefault(os.path.abspath(run_dir), num)
        _, first_choices, first_yaml = loaded[first]
        changed = changed_settings(first_yaml, config_yaml, first_choices, choices, ignore=("run.",))
        if changed:
            apart = [[o for o in a if o not in b] for a, b in ((points[first], point), (point, points[first]))]
            raise ConfigError(f"sweep points {_point(first, apart[0])} and {_point(num, apart[1])} would train in one "
                              f"run directory {run_dir} with other settings ({summary(changed)})",
                              "run.dir" if cfg.run.dir else "run.tag",
                              _own_dirs_fix(cfg.run.dir, apart[1], first_yaml, config_yaml))


def _own_dirs_fix(run_dir: str | None, overrides: list[str], first_yaml: str, config_yaml: str) -> str:
    """How to give each point of a sweep its own run directory: a run.tag interpolating a setting they differ in
    (the swept one, else the family key of a swept preset's section: 'run.tag=${optim.name}')."""
    from utils.checkpoints.run_dir import IDENTITY_KEYS, flat_config

    first, other = flat_config(first_yaml), flat_config(config_yaml)
    swept = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    keys = sorted((k for k in first.keys() & other.keys() if not k.startswith("run.") and first[k] != other[k]
                   and all(re.fullmatch(r"[\w.+=-]+", str(v)) for v in (first[k], other[k]))),
                  key=lambda k: (k not in swept, k.rsplit(".", 1)[-1] not in IDENTITY_KEYS, k))
    key = keys[0] if keys else "optim.lr"
    name = "" if key.rsplit(".", 1)[-1] in IDENTITY_KEYS else key.rsplit(".", 1)[-1]
    tag = f"'run.tag={name}${{{key}}}'"
    if run_dir:
        return (f"drop run.dir= so that each point gets its own folder under run.root, named apart by {tag}, "
                "or set hydra.sweep.dir=DIR (point i trains in DIR/i)")
    return f"name each point's folder apart with {tag}, or set hydra.sweep.dir=DIR (point i trains in DIR/i)"


def _launcher_world(hydra_args: list[str]) -> int | None:
    """The ranks of a point under a submitit launcher with several tasks per point; None: the point starts the
    ranks its layout needs."""
    if not (_value(hydra_args, "hydra/launcher") or "").startswith("submitit"):
        return None
    try:
        world = math.prod(int(_value(hydra_args, f"hydra.launcher.{k}") or 1) for k in ("nodes", "tasks_per_node"))
    except ValueError:
        return None
    return world if world > 1 else None


def _value(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (the last one wins, as in Hydra), else None."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and o.lstrip("+~").split("=", 1)[0] == key]
    return values[-1] if values else None


def check_launcher_ranks(hydra_args: list[str], points: list[list[str]], cfgs: list) -> None:
    """Under a submitit launcher with several tasks per point each task is one rank: refuse, before any job
    is submitted, a point whose layout does not fit hydra.launcher.nodes x tasks_per_node (else each of its
    ranks fails inside its job, after the queue wait)."""
    from utils.comm import check_grid
    from utils.launch_env import LaunchEnv

    if not (_value(hydra_args, "hydra/launcher") or "").startswith("submitit"):
        return
    try:
        nodes, per_node = (int(_value(hydra_args, f"hydra.launcher.{k}") or 1) for k in ("nodes", "tasks_per_node"))
    except ValueError:
        return  # not a number: Hydra's own check refuses it
    if nodes * per_node == 1:
        return  # one task per point: it starts its layout's local ranks itself
    for num, (point, cfg) in enumerate(zip(points, cfgs)):
        try:
            check_grid(cfg.parallel, LaunchEnv(world_size=nodes * per_node))
        except ConfigError as err:
            raise ConfigError(f"sweep point #{num} ({' '.join(point) or 'no overrides'}) would run on "
                              f"hydra.launcher.nodes x tasks_per_node = {nodes} x {per_node} = {nodes * per_node} "
                              f"ranks, but {err.what}", "hydra.launcher.tasks_per_node",
                              "give every point a layout that fits the launcher's ranks, or set "
                              "hydra.launcher.nodes and hydra.launcher.tasks_per_node to fit it") from None


def main(argv: list[str]) -> int:
    """Run Hydra's app (@hydra.main on config/config.yaml) for this command line; the exit status."""
    from hydra import main as hydra_main
    from hydra._internal.utils import get_args_parser

    from utils.cli.config import CONFIG_DIR, register_schemas

    args = get_args_parser().parse_args(argv)
    multirun = args.multirun or "hydra.mode=MULTIRUN" in args.overrides
    run_root = None
    other_config = args.config_name or args.config_path or args.config_dir  # Hydra composes and checks it
    if args.cfg is None and args.info is None and not (args.hydra_help or args.shell_completion or other_config):
        try:
            run_root = check_points(args.overrides, multirun)
        except ConfigError as err:
            exit_bad_input(err)
    try:
        register_schemas()  # before Hydra composes: config.yaml's defaults name the schemas; the families found
    except ConfigError as err:
        exit_bad_input(err)
    # Submitit's job processes import this module (to unpickle `task`) from wherever they start.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths if str(ROOT) in paths else [str(ROOT), *paths])
    argv = with_launcher_defaults(with_sweep_subdir(argv, args.overrides), args.overrides)
    sys.argv = [sys.argv[0], *argv]  # @hydra.main reads sys.argv
    try:
        hydra_main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(task)()
    finally:
        if multirun and run_root is not None and not _given(args.overrides, "hydra.sweep.dir"):
            (Path(run_root) / "multirun.yaml").unlink(missing_ok=True)  # Hydra's record, in the default sweep dir
    return 0


def task(job_cfg) -> int:
    """One point of a sweep (or a Hydra run): convert Hydra's config as a single run's and train it."""
    submitit_handler = record_submitit_stops()  # a submitit job's first lines: before torch is imported

    from hydra.core.hydra_config import HydraConfig

    from utils.cli.config import typed_config
    from utils.cli.local_launch import run
    from utils.comm import destroy_grid

    hydra_cfg = HydraConfig.get()
    argv, failure = list(hydra_cfg.overrides.task), None
    try:
        job_dir = chosen_job_dir(hydra_cfg)
        if job_dir is not None and job_cfg.run.dir is None:
            job_cfg.run.dir = job_dir  # as run.dir=DIR would set it (the ranks train_mp starts get that)
            argv.append(f"run.dir='{_quoted(job_dir)}'")
        cfg, choices, config_yaml = typed_config(job_cfg, hydra_cfg.runtime.choices, argv)
        export_submitit_ranks()
        check_handover(hydra_cfg, cfg)
        code = run(cfg, choices, config_yaml, argv)
    except ConfigError as err:
        print(err.line(), file=sys.stderr, flush=True)
        code, failure = EXIT_BAD_INPUT, err.line()
    finally:
        destroy_grid()
    if code and os.environ.get("SUBMITIT_EXECUTOR"):  # requeued by submitit, or a FAILED job the sweep reports
        end_submitit_point(code, submitit_handler, f"sweep point #{hydra_cfg.job.num}", failure)
    if code:
        raise SystemExit(code)  # the basic launcher: the sweep stops here, with this point's status
    return 0


def chosen_job_dir(hydra_cfg) -> str | None:
    """Hydra's job folder when the command line chose one (hydra.run.dir or hydra.sweep.dir), else None."""
    key = "hydra.sweep.dir" if hydra_cfg.mode.name == "MULTIRUN" else "hydra.run.dir"
    return hydra_cfg.runtime.output_dir if _given(hydra_cfg.overrides.hydra, key) else None


def _quoted(text: str) -> str:
    """`text` inside a single-quoted Hydra override value."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def export_submitit_ranks() -> None:
    """Under a submitit launcher with several tasks per point, each task is one rank: export MASTER_ADDR/
    PORT, RANK, WORLD_SIZE, LOCAL_RANK from the job (utils/launch_env.py reads them as torchrun's). GPUs stay
    as Slurm shows them: pick_device gives local rank r GPU r, or the task's only one."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def check_handover(hydra_cfg, cfg) -> None:
    """The ranks train_mp.py starts compose config/config.yaml from the point's overrides: refuse a layout of
    several ranks started as one process under another primary config (-cn/-cp/-cd), which they would miss."""
    from utils.cli.config import CONFIG_DIR
    from utils.cli.local_launch import starts_local_ranks

    sources = {(s.provider, s.path) for s in hydra_cfg.runtime.config_sources}
    own = hydra_cfg.job.config_name == "config" and ("main", str(CONFIG_DIR)) in sources and \
        not any(provider == "command-line" for provider, _ in sources)
    if not own and starts_local_ranks(cfg):
        raise ConfigError("the local ranks of this layout would not see the config chosen with -cn/-cp/-cd",
                          "parallel", "start the ranks with torchrun or srun, or set hydra.launcher.tasks_per_node")


def with_launcher_defaults(argv: list[str], overrides: list[str]) -> list[str]:
    """hydra/launcher=submitit_slurm without hydra.launcher.max_num_timeout: submitit's own default, so that a
    point stopped at its time limit (with a checkpoint) is requeued and resumes."""
    if _value(overrides, "hydra/launcher") != "submitit_slurm" or _given(overrides, "hydra.launcher.max_num_timeout"):
        return argv
    return [*argv, f"hydra.launcher.max_num_timeout={SUBMITIT_MAX_NUM_TIMEOUT}"]


def record_submitit_stops():
    """In a submitit job (its task has no train.py first lines): submitit's handler for its time-limit signal
    (SIGUSR2), kept to hand a stopped point back to submitit, then the trainer's record-only stop handlers in
    its place; None elsewhere (train.py installed them already)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    handler = signal.getsignal(signal.SIGUSR2)
    record_stop_signals()
    return handler


def end_submitit_point(code: int, handler, name: str, failure: str | None) -> NoReturn:
    """End a submitit job whose point did not finish (status `code`), so that Slurm shows what happened:

    75 (every rank stopped with a checkpoint): rank 0 calls submitit's own signal handler now, which asks the
    launcher for the same point again (its `checkpoint`), requeues the job (for a time limit at most
    hydra.launcher.max_num_timeout times) and exits; the requeued job resumes from the checkpoint. Not
    requeued: the reason goes into every task's result, and the job fails with 75.
    Any other status: this task's result is the error, and the job fails with the status (before, Hydra
    caught the error inside the job, which Slurm then showed as COMPLETED 0:0)."""
    from submitit import JobEnvironment

    env = JobEnvironment()
    if code == EXIT_PREEMPTED:
        if env.global_rank != 0:
            raise SystemExit(code)  # rank 0 hands the job to submitit, or writes every task's result
        reason = "no submitit handler for SIGUSR2"
        if callable(handler):
            try:
                handler(signal.SIGUSR2, None)  # requeued: submitit exits here
                reason = "submitit did not requeue it"
            except Exception as err:  # noqa: BLE001 - e.g. "timed-out too many times", scontrol refused
                reason = str(err).strip().splitlines()[-1]
        message = (f"{name} stopped with a checkpoint (exit {code}) and was not requeued ({reason}): run the "
                   "same sweep again to continue from it (raise hydra.launcher.max_num_timeout for more requeues)")
        tasks = range(env.num_tasks)
    else:
        message = f"{name} exited with status {code}: {failure or 'see its log'} ({env.paths.stderr})"
        tasks = [env.global_rank]
    write_error_results(env, tasks, message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)  # past Hydra's run_job and submitit's process_job, which catch only Exceptions


def write_error_results(env, tasks, message: str) -> None:
    """What submitit's process_job writes for a task that raised: ("error", text) in the task's result file,
    which the sweep's side reads (it raises the error) without asking Slurm's accounting."""
    from submitit.core.utils import JobPaths, cloudpickle_dump, temporary_save_path

    for task_id in tasks:
        path = JobPaths(os.environ["SUBMITIT_FOLDER"], job_id=env.job_id, task_id=task_id).result_pickle
        with temporary_save_path(path) as tmp:
            cloudpickle_dump(("error", message), tmp)
