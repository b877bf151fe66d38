"""Pipeline stages cut from the one model definition, and the torch stages that run them.

- `cut_for_rank(model, plan, pp_rank)` deletes from a full serial model what this rank's stages do not
  hold, before tensor and context parallelism shard the rest: the blocks it keeps stay under their
  global names (`blocks` becomes an `nn.ModuleDict` keyed by the block index), the model's first part
  (`embed`) stays only with stage 0 and its last part (`output`) only with the last stage
  (`PIPELINE_ENDS` of networks/vit/model.py and networks/transformer.py names their attributes). Parts
  without parameters (dropouts, sequence markers, the criterion) stay everywhere. So the rank's module
  has the full model's state-dict names for what it holds: checkpoints keep global names, and the
  rank modules of a pipeline partition the full model's keys.
- `StageModule`: one stage of a cut model (a rank holds one, or two under looped and V schedules):
  its blocks and, on the first and last stage, the ends it runs, registered under the same names.
  A stage that starts inside the sequence-split region first tells the region's layouts the full
  sequence length (`enter_regions`), as the 'enter' marker does on the first stage.
  Between stages travels the residual stream, (B, N_local, C) in `StageModule.activation_dtype`, the one
  declaration the torch stages' buffers and `PipelineForward`'s receives use; a non-last stage whose
  output differs raises (the receiver would otherwise read its bytes as the declared dtype, silently).
- The torch stages that run them (`CountedStage`, `build_stages`) are in distributed/pipeline/torch_stages.py,
  imported only by a run with a pipeline (torch.distributed.pipelining brings torch._dynamo: about a second of
  every process start).

Tied embeddings: when the first and last stage are on different ranks, each holds a copy of the
weight (equal at the start); `Pipeline.sync_grads` sums their gradients so they stay equal.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed.collectives import split_sizes
from distributed.context.parallelize import EnterContext
from distributed.pipeline.stage_plan import PipelinePlan
from distributed.tensor.layers import ScatterSequence


def _ends(model: nn.Module) -> tuple[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]]:
    """((first part's method, its attributes), (last part's method, its attributes))."""
    (first, first_names), (last, last_names) = model.PIPELINE_ENDS.items()
    return (first, first_names), (last, last_names)


def _holds_parameters(value) -> bool:
    return isinstance(value, nn.Parameter) or (isinstance(value, nn.Module) and any(True for _ in value.parameters()))


def cut_for_rank(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> nn.Module:
    """Keep (in place) only what pp rank `pp_rank`'s stages hold; returns `model`. `model.pipeline_tied` names
    the kept parameters the full model shares with a dropped part (a tied embedding whose head another pp rank
    holds): found from the model's own sharing, not from names or settings, and kept as names (the build
    allocates new tensors later); the pipeline sums their gradients over the ranks holding the ends
    (distributed/pipeline/schedule.py)."""
    stages = plan.stages_of(pp_rank)
    keep = {i for s in stages for i in plan.blocks_of(s)}
    owners: dict[int, set[str]] = {}  # a parameter -> the top-level parts holding it
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name.split(".")[0] if not name.startswith("blocks.") else
                                                 ".".join(name.split(".")[:2]))
    model.blocks = nn.ModuleDict({name: b for name, b in model.blocks.named_children() if int(name) in keep})
    (_, first_names), (_, last_names) = _ends(model)
    dropped = (first_names if 0 not in stages else ()) + (last_names if plan.num_stages - 1 not in stages else ())
    dropped_parts = {name for name in dropped if _holds_parameters(getattr(model, name))}
    for name in dropped_parts:
        setattr(model, name, None)
    model.pipeline_tied = [name for name, p in model.named_parameters() if owners[id(p)] & dropped_parts]
    return model


def enter_regions(model: nn.Module, length: int, device: torch.device) -> int:
    """Fix the sequence layouts of `model`'s split region for `length` tokens, as its 'enter' marker
    does; returns the tokens this rank holds inside the region."""
    for module in model.modules():  # pre-order: cp's split wraps tp's
        if isinstance(module, EnterContext):
            module.shards.enter(length, device)
            length = module.shards.sizes[module.shards.axis.rank]
        elif isinstance(module, ScatterSequence):
            module.shards.enter(length)
            length = split_sizes(length, module.axis.size)[module.axis.rank]
    return length


def head_tokens(model: nn.Module, length: int) -> int:
    """Tokens reaching the head for `length` (after cp's split; tp's is gathered before the head)."""
    shards = getattr(model, "context_shards", None)
    return length if shards is None else shards.sizes[shards.axis.rank]


class StageBlocks(nn.ModuleDict):
    """A stage's blocks in order (keyed by the block index, as the model's `blocks`), run as one module: under
    FSDP the unit one root covers (distributed/fsdp.py `root_over_stage`)."""

    def forward(self, x: torch.Tensor, documents=None) -> torch.Tensor:
        for block in self.values():
            x = block(x) if documents is None else block(x, documents=documents)
        return x


class StageModule(nn.Module):
    """Stage `index` of a cut model: its blocks and the model's ends it runs, under their global names.

    `length` (tokens of the full sequence) must be set before the stage runs.
    `autocast`: the context its forward runs in (the loss is computed outside, in float32).
    """

    # The residual stream stays in the fp32 weights' dtype under every precision: autocast computes the
    # matmuls in bf16/fp16 and adds their outputs to the fp32 stream, and FSDP's policy casts nothing
    # (distributed/fsdp.py). The one declaration of what stages exchange.
    activation_dtype: torch.dtype = torch.float32

    def __init__(self, model: nn.Module, index: int, plan: PipelinePlan, autocast):
        super().__init__()
        self.index, self.autocast, self.length = index, autocast, 0
        self.is_first, self.is_last = index == 0, index == plan.num_stages - 1
        self.blocks = StageBlocks({str(i): model.blocks[str(i)] for i in plan.blocks_of(index)})
        (self.first_part, first_names), (self.last_part, last_names) = _ends(model)
        for name in (first_names if self.is_first else ()) + (last_names if self.is_last else ()):
            value = getattr(model, name)
            if isinstance(value, nn.Parameter):
                self.register_parameter(name, value)
            else:
                setattr(self, name, value)
        self._model = (model,)  # not a submodule: its other parts belong to other stages

    def activation_shape(self, batch: int, device: torch.device) -> tuple[int, ...]:
        """The shape of the activations this stage receives or sends for `batch` samples of `length` tokens (the
        family's `stage_shape` of the rank's tokens); fixes the split region's layouts for `length` on the way."""
        model = self._model[0]
        return model.stage_shape(batch, enter_regions(model, self.length, device))

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """`ids`: the micro-batch's token ids, given to every stage when the rows are packed documents (each
        stage reads their document structure, `read_documents`, as the whole model does)."""
        model = self._model[0]
        shape = self.activation_shape(x.shape[0], x.device)
        documents = None if ids is None else model.read_documents(ids)
        with self.autocast():
            if self.is_first:
                x = getattr(model, self.first_part)(x)
            x = self.blocks(x, documents)
            if self.is_last:
                return getattr(model, self.last_part)(x)
        if x.dtype != self.activation_dtype or tuple(x.shape) != shape:
            raise RuntimeError(f"pipeline stage {self.index} returns a {x.dtype} {tuple(x.shape)} tensor where the "
                               f"stages exchange {self.activation_dtype} {shape}: a layer changed the residual "
                               "stream's dtype or shape (the next stage would misread it)")
        return x
