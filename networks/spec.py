"""A model family as one spec: what the framework needs of a model, declared once.

A family is its schema, the task it trains with and a builder (`ModelSpec`), declared in a family module
(`FAMILY = ModelSpec(...)` and its `model=` PRESETS: utils/tasks/registry.py's contract, found through a
`dlscale.families` entry point or DLSCALE_FAMILIES); the model the builder returns answers the rest (`FamilyModel`):

    built where        the builder runs under torch.device("meta") in the real build (shapes, ties, no
                       memory); buffers are computed by the modules that hold them (`init_buffers(device)`)
    shard init         init_rules(): single-process name -> networks.initialization.Init, drawn shard by shard
    parallel plan      parallel_plan(): the roles tensor, sequence, context and pipeline parallelism act on
    FLOPs              matmul_params(): weights in matrix multiplies (utils/engine/flops.py's formula)
    pipeline shapes    PIPELINE_ENDS, embed(), output(), num_tokens(), output_shape(): the stages' ends and
                       the activation between stages
    loss               criterion(output, target): the training loss, also what a pipeline's last stage
                       computes; a task whose loss is anything else under some settings says so
                       (`Task.loss_is_criterion`) and pp is refused there, instead of a loss term dropped
    Hugging Face       hf_model_types: the `model_type`s utils/checkpoints/hf.py exchanges with the family

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


@dataclass(frozen=True)
class ModelSpec:
    """A model family (`model.arch`) and everything the framework needs to build, split and exchange it."""

    arch: str  # the `model.arch` tag its schema carries
    name: str  # as messages name it
    schema: type  # the config dataclass of `model=` (validated in its __post_init__)
    presets: str  # the presets a user chooses from, for messages ("model=vit_tiny, vit_base or vit_large")
    task: type  # the Task it trains with (its data: task.DATA_KIND, DATA_NAME, DATA_SCHEMAS)
    build: Callable[[Any, Any], nn.Module]  # (model config, task) -> the serial FamilyModel
    hf_model_types: tuple[str, ...] = ()  # Hugging Face model types its adapter reads and writes


def check_family_model(model: nn.Module) -> list[str]:
    """The parts of the FamilyModel contract `model` lacks (a meta build is enough), for a new family's tests."""
    wanted = [name for name in ("PIPELINE_ENDS", "blocks", "criterion", "init_rules", "parallel_plan",
                                "matmul_params", "embed", "output", "num_tokens", "output_shape")]
    missing = [name for name in wanted if not hasattr(model, name)]
    if "init_rules" not in missing:
        names = {n for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, nn.Parameter)}
        missing += [f"init_rules()[{n!r}]" for n in sorted(names - model.init_rules().keys())]
    return missing
