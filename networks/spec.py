"""A model family as one spec: what the framework needs of a model, declared once.

A family is a folder (networks/<name>/, or a package outside the tree) whose module defines
`FAMILY = ModelSpec(...)` and its `model=` PRESETS (utils/tasks/registry.py's contract: the built-in folders are
found by a scan of networks/, each of its packages a family; the others through a `dlscale.families` entry point
or DLSCALE_FAMILIES).
The spec declares what is known from the config alone; the model its builder returns answers the rest
(`FamilyModel`):

    task               the workload it trains with ("language", "weather": utils/tasks/), whose data it reads
    built where        the builder runs under torch.device("meta") in the real build (shapes, ties, no
                       memory); buffers are computed by the modules that hold them (`init_buffers(device)`)
    layout rules       spec.check_layout(model config, parallel config): what it refuses (heads over tp, ...),
                       checked once with the config, before any rank starts
    pipeline split     spec.blocks(model config): the number of its `blocks`, the units pipeline stages take
    capabilities       spec.documents: it reads packed documents (`documents`, `read_documents`); spec.decodes: it
                       decodes with a KV cache (`forward(idx, decode)`, what utils.generate samples from)
    shard init         init_rules(): single-process name -> networks.initialization.Init, drawn shard by shard
    parallel plan      parallel_plan(): the roles tensor, sequence, context and pipeline parallelism act on
    FLOPs              matmul_params(): weights in matrix multiplies; attention_layers(): (layers, width,
                       causal) of its softmax attention (utils/engine/flops.py's formula)
    pipeline shapes    PIPELINE_ENDS, embed(), output(), num_tokens(), output_shape(), stage_shape(): the
                       stages' ends and the activation between stages
    loss               criterion(output, target): the training loss, also what a pipeline's last stage
                       computes; a task whose loss is anything else under some settings says so
                       (`Task.loss_is_criterion`) and pp is refused there, instead of a loss term dropped
    decoding           a language model also gives `vocab_size`, `padded_vocab` and `cfg.max_positions`, which
                       greedy decoding at validation, sampling and evaluation read
    Hugging Face       spec.hf: its adapter (networks/exchange.py `HFAdapter`: config.json both ways and the
                       rules its tensors are made by), which import, sliced import and export read

Nothing else names a family: the build, the trainer, the checkpoints and the tools go through these.
A family's attention core must be `networks.blocks.ScaledDotProductAttention` (plain softmax attention) to
run under context parallelism, which replaces it by a distributed one; another core (a window, sliding
attention) is refused there (distributed/context/parallelize.py), never silently replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from networks.exchange import HFAdapter
from networks.initialization import Init
from networks.parallel_plan import ParallelPlan


class FamilyModel(Protocol):
    """What the built model of a family provides (see the module docstring)."""

    PIPELINE_ENDS: Mapping[str, tuple[str, ...]]
    blocks: nn.Module
    criterion: nn.Module

    def init_rules(self) -> dict[str, Init]: ...
    def parallel_plan(self) -> ParallelPlan: ...
    def matmul_params(self) -> int: ...
    def embed(self, x: torch.Tensor) -> torch.Tensor: ...
    def output(self, x: torch.Tensor) -> torch.Tensor: ...
    def num_tokens(self, x: torch.Tensor) -> int: ...
    def output_shape(self, batch: int, tokens: int) -> tuple[int, ...]: ...
    def stage_shape(self, batch: int, tokens: int) -> tuple[int, ...]: ...
    def attention_layers(self) -> tuple[int, int, bool]: ...


def no_layout_rules(model: Any, parallel: Any) -> None:
    """A family that every layout the grid accepts can split."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model family (`model.arch`) and everything the framework needs to build, split and exchange it."""

    arch: str  # the `model.arch` tag its schema carries
    name: str  # as messages name it
    schema: type  # the config dataclass of `model=` (validated in its __post_init__)
    presets: str  # the presets a user chooses from, for messages ("model=vit_tiny, vit_base or vit_large")
    tiny: str  # its smallest preset: what a tool composes before setting a checkpoint's model.* on it
    task: str | type  # the workload it trains with: a name of utils/tasks' TASKS, or a Task class
    build: Callable[[Any, Any], nn.Module]  # (model config, task) -> the serial FamilyModel
    blocks: Callable[[Any], int]  # model config -> the number of its `blocks` (the pipeline's units)
    check_layout: Callable[[Any, Any], None] = no_layout_rules  # (model, parallel config): ConfigError if refused
    documents: bool = False  # reads packed documents (data.packing=documents): `documents`, `read_documents`
    decodes: bool = False  # decodes token by token with a KV cache (`forward(idx, decode)`): utils.generate samples
    hf: HFAdapter | None = None  # its exchange with Hugging Face folders (None: none)


def check_family_model(model: nn.Module) -> list[str]:
    """The parts of the FamilyModel contract `model` lacks (a meta build is enough), for a new family's tests."""
    wanted = [name for name in ("PIPELINE_ENDS", "blocks", "criterion", "init_rules", "parallel_plan",
                                "matmul_params", "attention_layers", "embed", "output", "num_tokens", "output_shape",
                                "stage_shape")]
    missing = [name for name in wanted if not hasattr(model, name)]
    if "init_rules" not in missing:
        names = {n for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, nn.Parameter)}
        missing += [f"init_rules()[{n!r}]" for n in sorted(names - model.init_rules().keys())]
    return missing
