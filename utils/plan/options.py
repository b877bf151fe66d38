"""The planner's command line (utils/plan/cost_model.py's docstring lists it): the hardware presets, the options
that change them, and the request they make."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from utils import ConfigError, require
from utils.plan.bandwidths import read_bandwidths


@dataclass
class Hardware:
    """Figures of one device kind: peak (utils.engine.flops.PEAK_TFLOPS key, or a number), links, memory."""

    peak: str | float  # PEAK_TFLOPS key, or dense TFLOP/s per device
    intra_gbs: float  # GB/s per direction between ranks of one node
    inter_gbs: float  # GB/s per GPU between nodes
    gpus_per_node: int
    memory_gb: float  # memory per device, GB (1e9 bytes)
    efficiency: float = 0.5  # fraction of the peak a step achieves
    device: str = "cuda"  # device type the layout runs on (settings resolved by device: sequence parallelism)


GPUS = {"h100": Hardware("H100", 450.0, 50.0, 8, 80.0), "a100": Hardware("A100", 300.0, 50.0, 8, 80.0),
        "cpu": Hardware(0.2, 5.0, 5.0, 1000, 1000.0, device="cpu")}
PCIE_GBS = 25.0
OPTIONS = {"--efficiency": "efficiency", "--peak-tflops": "peak", "--intra-gbs": "intra_gbs",
           "--inter-gbs": "inter_gbs", "--gpus-per-node": "gpus_per_node", "--memory-gb": "memory_gb"}


@dataclass
class Request:
    overrides: list[str]
    hardware: Hardware
    gpu: str = "h100"
    world: int = 0  # 0: plan the one layout the overrides give
    as_json: bool = False
    jobs: int = 0  # layouts planned at once (--jobs); 0: one per CPU core this process may use
    links_from: str = ""  # --bandwidths: the doctor's file the link figures come from
    vocab: int | None = None  # --vocab: a language model's vocabulary (the planner reads no data)


def parse_args(argv: list[str]) -> Request:
    """Planner options out of argv; the rest are Hydra overrides."""
    req, values, it = Request([], GPUS["h100"]), {}, iter(argv)
    pcie, measured = False, None
    for arg in it:
        key, eq, value = arg.partition("=")
        if key == "gpu":
            require(value in GPUS, f"unknown gpu '{value}'", "gpu", "choose " + ", ".join(GPUS))
            req.gpu = value
        elif key == "--bandwidths":
            value = value if eq else next(it, "")
            require(bool(value), "--bandwidths needs a file", "--bandwidths", "give the doctor's bandwidths JSON")
            measured = read_bandwidths(value)
        elif key in OPTIONS or key in ("--world", "--jobs", "--vocab"):
            value = value if eq else next(it, "")
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            require(number > 0, f"bad {key} value '{value}'", key, "give a positive number")
            values[key] = number
        elif arg in ("--json", "--pcie"):
            req.as_json, pcie = req.as_json or arg == "--json", pcie or arg == "--pcie"
        elif arg.startswith("--"):
            raise ConfigError(f"unknown option '{arg}'", arg, "see python -m utils.plan --help")
        else:
            req.overrides.append(arg)
    req.world, req.jobs = int(values.pop("--world", 0)), int(values.pop("--jobs", 0))
    req.vocab = int(values.pop("--vocab")) if "--vocab" in values else None
    hw = Hardware(**asdict(GPUS[req.gpu]))
    hw.intra_gbs = PCIE_GBS if pcie else hw.intra_gbs
    if measured is not None:  # the doctor's figures replace the preset's; explicit flags (below) win
        hw.intra_gbs = measured.intra_gbs or hw.intra_gbs
        hw.inter_gbs = measured.inter_gbs or hw.inter_gbs
        req.links_from = measured.source()
    for key, number in values.items():
        setattr(hw, OPTIONS[key], int(number) if key == "--gpus-per-node" else number)
    req.hardware = hw
    return req
