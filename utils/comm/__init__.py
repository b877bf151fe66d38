"""The parallel grid: axis sizes and order -> process groups, passed explicitly to everything else.

`ParallelConfig` (utils/schema.py) is the schema of the `parallel` config group. `rank_layout` is the pure math (which
global ranks form each group of each axis), `Grid` is the object the rest of the code receives, and
`init_grid` initializes torch.distributed from the launch environment (torchrun, Slurm, or one bare
process) and builds the groups on a torch DeviceMesh. A size-1 axis has no process group and every
collective on it is skipped, so serial code needs no `if distributed:`.

Order: `order="tp-cp-dp-pp"` lists the axes from nearest ranks (fastest varying) to farthest, as in
the NERSC tutorial: with 8 ranks, tp=4, dp=2 and order tp-dp, the tp groups are [0,1,2,3] and
[4,5,6,7] and the dp groups are [0,4], [1,5], [2,6], [3,7].
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import gc
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from utils import ConfigError, require
from utils.comm.timeouts import set_group_timeouts
from utils.launch_env import LaunchEnv, launch_env, pick_device
from utils.schema import AXIS_NAMES, ParallelConfig, order_names


class Axis(str, enum.Enum):
    """Grid axes: tensor, context, data and pipeline parallelism."""

    TP = "tp"
    CP = "cp"
    DP = "dp"
    PP = "pp"


AXES = tuple(Axis)
assert tuple(a.value for a in AXES) == AXIS_NAMES  # the schema names the same axes in the same order
# The grid's concepts by the axes they span; Grid.batch, .replicas, .same_batch and .metrics state the rules.
BATCH_AXES, REPLICA_AXES, SAME_BATCH_AXES = (Axis.DP,), (Axis.DP, Axis.CP), (Axis.TP, Axis.CP)
METRIC_AXES = BATCH_AXES + (Axis.PP,)
# Every group any layer may use, created eagerly by init_grid (later creation on some ranks only would hang).
GROUPS_BUILT_AT_START = ((Axis.TP,), (Axis.CP,), BATCH_AXES, (Axis.PP,), REPLICA_AXES, SAME_BATCH_AXES, METRIC_AXES,
                         AXES)


def parse_order(order: str) -> tuple[Axis, ...]:
    """'tp-cp-dp-pp' -> axes nearest first; missing axes are appended in default order (`order_names`)."""
    return tuple(Axis(n) for n in order_names(order))


def resolve_sizes(cfg: ParallelConfig, world_size: int) -> dict[Axis, int]:
    """Axis sizes for this world size; raises ConfigError when the grid does not fit."""
    model_parallel = cfg.tp * cfg.cp * cfg.pp
    dp = cfg.dp or world_size // model_parallel
    fits = dp >= 1 and dp * model_parallel == world_size
    require(fits, f"world size {world_size} does not fit tp={cfg.tp} x cp={cfg.cp} x pp={cfg.pp}"
            + (f" x dp={cfg.dp}" if cfg.dp else ""), "parallel",
            f"launch a multiple of {model_parallel} ranks" + (f" ({dp * model_parallel})" if cfg.dp else "")
            + " or change the parallel sizes")
    return {Axis.TP: cfg.tp, Axis.CP: cfg.cp, Axis.DP: dp, Axis.PP: cfg.pp}


def batch_parts(sizes: dict[Axis, int]) -> int:
    """Into how many parts the global batch is split under these axis sizes (`Grid.batch`'s size, known
    before any grid exists)."""
    return math.prod(sizes[a] for a in BATCH_AXES)


def rank_layout(sizes: dict[Axis, int], order: tuple[Axis, ...]) -> dict[Axis, list[list[int]]]:
    """For each axis, the list of rank groups along it (pure math, no processes)."""
    world = math.prod(sizes.values())
    # Slowest-varying axis first, so the first axis of `order` varies fastest across ranks.
    dims = list(reversed(order))
    ranks = torch.arange(world).reshape([sizes[a] for a in dims])
    layout = {}
    for axis in order:
        d = dims.index(axis)
        layout[axis] = ranks.movedim(d, -1).reshape(-1, sizes[axis]).tolist()
    return layout


@dataclass
class AxisGroup:
    """One rank's view of an axis (or a product of axes): size, rank, process group, byte counter.

    Layers, collectives and the trainer receive AxisGroups, never axis names. `counter` holds the bytes
    this rank sent over the group; `distributed.counting.record` raises it (in eager code and inside
    compiled graphs; see there why it is an int64 CPU tensor changed through `.data`).
    """

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None = None
    ranks: list[int] = field(default_factory=list)  # global ranks in this rank's group
    counter: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64),
                                  repr=False, compare=False)

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank sent over the group since the last reset (ring algorithm volume)."""
        return int(self.counter)

    @bytes_moved.setter
    def bytes_moved(self, value: int) -> None:
        self.counter.data.fill_(value)  # in place (compiled graphs hold this tensor), version unchanged


class Grid:
    """Sizes, ranks and groups of each axis for this process. Build with `init_grid` or `Grid.serial()`."""

    def __init__(self, sizes: dict[Axis, int], order: tuple[Axis, ...], rank: int = 0,
                 device: torch.device | None = None, mesh=None):
        self.sizes, self.order, self.global_rank = dict(sizes), tuple(order), rank
        self.world_size = math.prod(sizes.values())
        self.device = device or torch.device("cpu")
        self.mesh = mesh  # torch DeviceMesh (dims slowest first), None for one process
        self.layout = rank_layout(self.sizes, self.order)
        self._axes: dict[str, AxisGroup] = {}
        self.frozen = False  # set by init_grid once the groups exist: no group is created later
        self._pipeline_ends: AxisGroup | None = None  # set by init_grid when pp > 2
        self.cp_hierarchy: tuple[AxisGroup, AxisGroup] | None = None  # (all-to-all group, ring) of hierarchical cp

    @classmethod
    def serial(cls, device: torch.device | None = None) -> Grid:
        """The grid of a one-process run: every axis has size 1."""
        return cls({a: 1 for a in AXES}, AXES, 0, device)

    def size(self, axis: Axis | str) -> int:
        return self.sizes[Axis(axis)]

    def rank(self, axis: Axis | str) -> int:
        return self.axis(axis).rank

    def axis(self, *axes: Axis | str) -> AxisGroup:
        """The AxisGroup of one axis or of the product of several (e.g. grid.axis(Axis.DP, Axis.CP)).

        Groups are created on first use; init_grid uses every combination the code needs up front,
        because creating a process group is a collective call.
        """
        keys = tuple(sorted({Axis(a) for a in axes}, key=self.order.index))
        keys = tuple(a for a in keys if self.sizes[a] > 1) or keys[:1]  # size-1 axes change no group
        name = "_".join(a.value for a in keys)
        if name not in self._axes:
            self._axes[name] = self._build_axis(keys, name)
        return self._axes[name]

    @property
    def pipeline_ends(self) -> AxisGroup | None:
        """The first and last rank of this rank's pp group (the pp axis itself at pp <= 2); None on the
        ranks between them."""
        if self.sizes[Axis.PP] <= 2:
            return self.axis(Axis.PP)
        return self._pipeline_ends

    @pipeline_ends.setter
    def pipeline_ends(self, axis: AxisGroup | None) -> None:
        self._pipeline_ends = axis
        if axis is not None:
            self._axes[axis.name] = axis  # counted with the other axes

    @property
    def batch(self) -> AxisGroup:
        """The ranks that split the global batch (dp): each takes its own 1/size of every step's samples, so
        losses and gradients are averaged over them (divided by its size)."""
        return self.axis(*BATCH_AXES)

    @property
    def replicas(self) -> AxisGroup:
        """The ranks that hold identical weights (dp x cp): gradients are reduced over them (summed over cp,
        whose ranks share samples, divided by `batch`'s size) and FSDP shards weights and gradients over them."""
        return self.axis(*REPLICA_AXES)

    @property
    def replica_mesh(self) -> DeviceMesh:
        """The 1-D DeviceMesh over `replicas` (FSDP's): the grid mesh's dim, or its dims flattened."""
        names = tuple(a.value for a in sorted(REPLICA_AXES, key=lambda a: -self.order.index(a)) if self.sizes[a] > 1)
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]._flatten("_".join(reversed(names)))

    @property
    def same_batch(self) -> AxisGroup:
        """The ranks that train on the same samples and share one reader (tp x cp): rank 0 of it reads, the
        others receive (SharedBatches). pp ranks see the same samples too, but each reads its own."""
        return self.axis(*SAME_BATCH_AXES)

    @property
    def metrics(self) -> AxisGroup:
        """The ranks whose validation sums add up to the global ones (`batch` x pp): each batch rank saw
        other samples, and only the last pipeline stage has outputs (the others add zeros)."""
        return self.axis(*METRIC_AXES)

    @property
    def world(self) -> AxisGroup:
        """Every rank of the job, as an axis (named by its non-trivial axes, e.g. 'tp_dp')."""
        return self.axis(*AXES)

    def _build_axis(self, keys: tuple[Axis, ...], name: str) -> AxisGroup:
        size = math.prod(self.sizes[a] for a in keys)
        ranks = self._group_ranks(keys)
        group = None
        if size > 1:
            assert self.mesh is not None, "a multi-rank axis needs an initialized mesh"
            assert not self.frozen, f"group {name} was not created at start (add it to GROUPS_BUILT_AT_START)"
            mesh_names = [a.value for a in sorted(keys, key=lambda a: -self.order.index(a))]
            if len(mesh_names) == 1:
                group = self.mesh[mesh_names[0]].get_group()
            elif size == self.world_size:
                group = dist.group.WORLD  # every rank, in global-rank order: no new group needed
            else:
                group = self.mesh[tuple(mesh_names)]._flatten(name).get_group()
        return AxisGroup(name, size, ranks.index(self.global_rank), group, ranks)

    def _group_ranks(self, keys: tuple[Axis, ...]) -> list[int]:
        """Global ranks sharing this rank's coordinates on every axis not in `keys`."""
        dims = list(reversed(self.order))
        grid = torch.arange(self.world_size).reshape([self.sizes[a] for a in dims])
        coord = [int(c) for c in (grid == self.global_rank).nonzero()[0]]
        index = tuple(slice(None) if a in keys else coord[i] for i, a in enumerate(dims))
        return grid[index].flatten().tolist()

    def comm_bytes(self) -> dict[str, int]:
        """Bytes moved so far per axis (and per axis product) by this rank."""
        return {name: g.bytes_moved for name, g in self._axes.items() if g.size > 1}

    def reset_comm_bytes(self) -> None:
        for g in self._axes.values():
            g.bytes_moved = 0

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    @property
    def name(self) -> str:
        """Short name for run directories: 'single' or e.g. 'tp2-dp2' (axes of size > 1, in grid order)."""
        return layout_name(self.sizes, self.order)

    @property
    def signature(self) -> str:
        """The layout's identity (world size, every axis size, the order), stable across releases:
        checkpoints record it and refuse to load under another one."""
        sizes = " ".join(f"{a.value}={self.sizes[a]}" for a in self.order)
        return f"world={self.world_size} {sizes} order={'-'.join(a.value for a in self.order)}"

    def describe(self) -> str:
        """Human-readable layout: the signature, then the groups of each axis."""
        return "\n".join([self.signature, *(f"  {a.value} groups: {self.layout[a]}" for a in self.order)])


def layout_name(sizes: dict[Axis, int], order: tuple[Axis, ...]) -> str:
    """'single' or e.g. 'tp2-dp2' (axes of size > 1, in grid order)."""
    return "-".join(f"{a.value}{sizes[a]}" for a in order if sizes[a] > 1) or "single"


def check_grid(cfg: ParallelConfig, env: LaunchEnv | None = None) -> dict[Axis, int]:
    """The axis sizes for the launch environment, validated without initializing anything."""
    return resolve_sizes(cfg, (env or launch_env()).world_size)


def init_grid(cfg: ParallelConfig, sizes: dict[Axis, int] | None = None) -> Grid:
    """Initialize torch.distributed (when there is more than one rank) and build the grid.

    `sizes`: the axis sizes `check_grid` resolved for this launch (resolved here when not given).
    """
    env = launch_env()
    sizes = sizes or resolve_sizes(cfg, env.world_size)
    assert math.prod(sizes.values()) == env.world_size, f"sizes {sizes} do not fit world size {env.world_size}"
    order = parse_order(cfg.order)
    device = pick_device(env.local_rank)
    if env.world_size == 1:
        return Grid(sizes, order, 0, device)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(
                seconds=cfg.init_timeout_s), device_id=device if device.type == "cuda" else None)
        except dist.DistStoreError as err:
            raise ConfigError(f"not all {env.world_size} ranks joined within {cfg.init_timeout_s} s ({err})",
                              "parallel.init_timeout_s", "check the other ranks' output: a rank that fails its "
                              "checks exits before joining") from None
        except dist.DistNetworkError as err:
            if "EADDRINUSE" not in str(err):
                raise
            raise ConfigError(f"the rendezvous port {os.environ.get('MASTER_PORT')} is in use on this node by "
                              "another process", "MASTER_PORT", "choose a free port below the kernel's ephemeral "
                              "range (/proc/sys/net/ipv4/ip_local_port_range), or unset it where the submit scripts "
                              "or train_mp.py choose one") from None
    grid = Grid(sizes, order, env.rank, device, build_mesh(sizes, order, device))
    for axes in GROUPS_BUILT_AT_START:
        grid.axis(*axes)  # creating a group is collective: every rank, same order, at start
    if sizes[Axis.PP] > 2:
        grid.pipeline_ends = _pipeline_ends(grid)
    if cfg.cp_attention == "hierarchical" and sizes[Axis.CP] > 1:
        grid.cp_hierarchy = _cp_hierarchy(grid, cfg.cp_a2a)
    grid.frozen = True
    set_group_timeouts(cfg.init_timeout_s)  # every group, the mesh's and new_group's too (utils/comm/timeouts.py)
    return grid


def _cp_hierarchy(grid: Grid, a2a: int) -> tuple[AxisGroup, AxisGroup]:
    """This rank's (all-to-all group, ring) in its cp group, cp rank c = g x a2a + i: the a2a nearest ranks of
    group g, and the ranks with the same i in every group; counted on the cp axis (comm/cp_bytes). Every
    rank creates every group, in the same order (creating a group is collective)."""
    cp = grid.axis(Axis.CP)
    mine = {}
    for ranks in grid.layout[Axis.CP]:
        inner = [ranks[g * a2a:(g + 1) * a2a] for g in range(len(ranks) // a2a)]
        outer = [ranks[i::a2a] for i in range(a2a)]
        for kind, groups in (("cp_a2a", inner), ("cp_ring", outer)):
            for members in groups:
                group = dist.new_group(members)
                if grid.global_rank in members:
                    mine[kind] = AxisGroup(kind, len(members), members.index(grid.global_rank), group, members,
                                           counter=cp.counter)
    return mine["cp_a2a"], mine["cp_ring"]

def _pipeline_ends(grid: Grid) -> AxisGroup | None:
    """The group of the first and last rank of this rank's pp group (None on the ranks between): the
    two copies of a tied embedding under a looped placement. Created for every pp group on every rank."""
    mine = None
    for ranks in grid.layout[Axis.PP]:
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair)  # collective: every rank creates every pair, in the same order
        if grid.global_rank in pair:
            mine = AxisGroup("pp_ends", 2, pair.index(grid.global_rank), group, pair)
    return mine


def background_group(grid: Grid) -> dist.ProcessGroup | None:
    """A gloo group of every rank for background work (asynchronous checkpoints): a collective issued from
    another thread must never share a group with the training loop's. None in one process. Collective:
    every rank calls it at the same point of setup."""
    return dist.new_group(backend="gloo") if grid.world_size > 1 else None


def build_mesh(sizes: dict[Axis, int], order: tuple[Axis, ...], device: torch.device) -> DeviceMesh:
    """A DeviceMesh whose dims run slowest-first (reverse of `order`), named by axis."""
    dims = list(reversed(order))
    return init_device_mesh(device.type, tuple(sizes[a] for a in dims), mesh_dim_names=tuple(a.value for a in dims))


def destroy_grid() -> None:
    """End torch.distributed and free its process groups now, while the interpreter is whole.

    `destroy_process_group` only forgets the groups: a run's objects still hold them, in reference cycles,
    with their gloo threads (15 in a tp2 x pp2 rank). Left to the collector, they were freed during the
    interpreter's finalization, where a gloo thread finishing its work can need the GIL being torn down:
    the likely cause of one rank's abort at exit after a complete run ("terminate called without an active
    exception"). So the cycles are collected here; the groups' destructors join their threads. DTensor's
    sharding-propagation caches (Python and C++) hold the specs of every op they saw, with their meshes and
    so the groups (4 in a dp2 FSDP rank), for the process's life (no collection frees them): emptied first."""
    if dist.is_initialized():
        dist.destroy_process_group()
        _clear_dtensor_caches()
        gc.collect()


@contextlib.contextmanager
def ends_its_grid():
    """A command's body (a decorator or a `with`): the process groups it starts are ended when it leaves
    (`destroy_grid`: a gloo thread left to the interpreter's finalization can abort the rank after its work is
    done); groups a caller started before are the caller's to end."""
    started = not dist.is_initialized()
    try:
        yield
    finally:
        if started:
            destroy_grid()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches, as torch.distributed.tensor.debug's
    `_clear_sharding_prop_cache` does, without importing that module (it imports inductor: 1.1 s here)."""
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is None:  # no DTensor in this process
        return
    # each looked up: a torch other than 2.13 (a device image's) may lack one, and a finished run must not fail
    # at its exit for a cache it could not empty (its groups are then freed at the interpreter's end, as before)
    python_cache = api.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    for clear in (getattr(python_cache, "cache_clear", None), fast_path):
        if clear is not None:
            clear()
