"""From a model built, cut, parallelized and sharded on the meta device to this rank's tensors on its device.

The build (utils/engine/build.py) never creates the full model: the serial model is built on meta (shapes,
ties and the module tree, no memory), the pipeline cut, tensor and context parallelism and FSDP2 act on meta
tensors, and only then does each rank allocate what it holds: its stages' parameters, as tp shards, as FSDP
shards. `materialize` allocates them and computes each shard's initial values from the model's rules
(networks/initialization.py) and the shard's place in the full tensor (distributed/placement.py), drawing at
most one block of rows beyond what the rank keeps. Peak host memory of the build: the rank's own weights plus
one block (or one whole tensor of fewer rows than a block, such as a position table).

Buffers are not weights: they are computed (rotary tables, index rows), so a module holding one recomputes
it on the device (`init_buffers(device)`); a real (non-meta) buffer is moved there as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed.placement import local_pieces
from networks.initialization import Init, fill_


def materialize(model: nn.Module, device: torch.device, *, rules: dict[str, Init] | None, seed: int) -> None:
    """Allocate the meta parameters of `model` (this rank's parts) on `device` and fill them from `rules`
    for `seed` (None: allocated without values, for the planner); buffers computed on `device`."""
    buffers = {(id(m), name): b for m in model.modules() for name, b in m._buffers.items() if b is not None}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter -> the modules holding it (a tied head)
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)  # FSDP2's shards re-registered by its _apply
    for (first, name), *others in holders.values():  # to_empty gives each holder of a plain tensor its own
        for module, other in others:
            module._parameters[other] = first._parameters[name]
    for module in model.modules():
        stale = []  # meta buffers: computed ones, which the module recomputes
        for name in module._buffers:
            old = buffers.get((id(module), name))
            if old is not None and old.is_meta:
                stale.append(name)
            elif old is not None:
                module._buffers[name] = old.to(device)
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
        else:
            assert not stale, f"{type(module).__name__} holds meta buffers {stale} and no init_buffers(device)"
    if rules is None:
        return
    for piece in local_pieces(model):
        assert piece.name in rules, f"{type(model).__name__}.init_rules() gives no rule for {piece.name}"
        fill_(piece.local, rules[piece.name], seed=seed, key=piece.name, full_shape=piece.full_shape,
              offsets=piece.offsets)
