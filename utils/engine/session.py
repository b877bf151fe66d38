"""One way for a tool to open a model: a run's checkpoint of any layout, or a Hugging Face folder, without a
training config.

    opened = open_model(path, "CHECKPOINT", kind="wikitext")   # config files read, no weight
    opened.family, opened.model_cfg, opened.data_cfg, opened.vocab    # what it holds
    model = opened.serial("cpu")                                       # the whole model in this process
    model, grid = opened.sharded(tp=2, pp=1)                           # this rank's part, under a layout
    task = opened.task(settings)                                       # the run's task on its data (forecasts)

`path` is a Hugging Face folder (config.json: its family is the one whose adapter reads its model_type), or a
run directory, its checkpoints/, checkpoints/latest or a step folder (the newest complete step: run_dir.py
`resolve_step`), whose config.yaml gives the family, the model and the data settings (`load_run`). Every model is
built by its family (`ModelSpec.build`, through the run's task) on the meta device and gets its weights
assigned: in one process (`serial`: the checkpoint's model entries, each checked against the model's names and
shapes; a Hugging Face folder through the family's adapter), or as training builds it (`sharded`: the grid of
tp x pp ranks, this rank's stages and shards, and its pieces of the weights, resharded by DCP or read by slices:
utils/engine/build.py). Tools (generate, evaluate, forecast, export) open models here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from networks.spec import ModelSpec
from utils import require
from utils.checkpoints.run_dir import TASK_FILE, load_run, read_facts, resolve_step
from utils.comm import Grid
from utils.tasks import task_of


@dataclass
class Opened:
    """A model source, described (no weight read yet)."""

    folder: Path  # the step folder or the Hugging Face folder
    family: ModelSpec
    model_cfg: Any  # the family's schema, the source's settings
    data_cfg: Any  # the run's data settings (a Hugging Face folder: the family's data schema's defaults)
    vocab: int | None  # tokens of the vocabulary (language models), before padding
    is_hf: bool  # a Hugging Face folder (else a run's step folder)
    taken: str | None = None  # "reading <step> (from <path>)" when a run folder stood for a step

    def task(self, settings: Any = None):
        """The family's task over the source's data settings (`load_data` not called), vocabulary set."""
        task_cls = task_of(self.family)
        task = task_cls(self.data_cfg, self.model_cfg, settings or task_cls.TASK_SCHEMA(), build=self.family.build)
        if self.vocab is not None:
            task.data_less_vocab = self.vocab  # the vocabulary without a corpus: the source's
        return task

    def serial(self, device: str | torch.device = "cpu", task=None) -> nn.Module:
        """The whole model in this process, in eval mode on `device`: built on the meta device by its family (from
        `task`, or the source's), each weight assigned."""
        from utils.checkpoints import hf

        with torch.device("meta"):
            model = (task or self.task()).build_model()
        if self.is_hf:
            state = hf.import_state(self.folder, self.model_cfg, self.vocab)
        else:
            state = checkpoint_state(self.folder, model)
        assign(model, state)
        for module in model.modules():
            if hasattr(module, "init_buffers"):
                module.init_buffers(torch.device(device))
        return model.to(device).eval()

    def sharded(self, *, tp: int, pp: int = 1, sequence_parallel: bool | None = None) -> tuple[nn.Module, Grid]:
        """(the model to call: this rank's shards, or the forward pass through the pipeline's stages; the grid) on
        the tp x pp ranks of the launch, built as training builds it. `sequence_parallel`: as training resolves
        it when None (on with GPUs); False for generation, whose one-token steps cannot be split over tp."""
        from utils.comm import check_grid, init_grid
        from utils.engine.build import build_model, load_model_weights
        from utils.schema import Config, ParallelConfig, TrainerConfig
        from utils.tasks import check_pairing

        data = self.data_cfg
        if hasattr(data, "seq_len") and hasattr(self.model_cfg, "max_positions"):  # whole contexts, nothing sampled
            data = dataclasses.replace(data, seq_len=self.model_cfg.max_positions, sample_tokens=0)
        cfg = Config(model=self.model_cfg, data=data, task=task_of(self.family).TASK_SCHEMA(),
                     parallel=ParallelConfig(tp=tp, pp=pp, dp=1, sequence_parallel=sequence_parallel),
                     trainer=TrainerConfig(global_batch_size=pp))
        check_pairing(cfg)  # the layout against the family's rules: one line, before any rank waits
        grid = init_grid(cfg.parallel, check_grid(cfg.parallel))
        task = self.task()
        built = build_model(cfg, task, grid)
        load_model_weights(built.raw, self.folder, model_cfg=cfg.model, task=task, grid=grid)
        model = built.forward if built.forward is not None else built.raw
        model.eval()
        return model, grid


def open_model(path: Path, setting: str, *, kind: str, data: tuple[str, ...] | list[str] = (),
               hf_folders: bool = True) -> Opened:
    """Describe the model at `path` (see the module doc), reading config files only. `kind`: the data kind the
    tool serves (a run of another is refused in one line); `data`: 'data.KEY=VALUE' settings for where the run's
    data lies now; `hf_folders`: whether a Hugging Face folder is accepted. ConfigError on `setting`."""
    from utils.checkpoints import hf

    path = Path(path)
    if hf_folders and (path / "config.json").is_file():
        config = hf.read_config(path)
        arch, settings = hf.model_settings(config)
        family = hf.spec_of(arch)
        task_cls = task_of(family)
        require(kind in task_cls.DATA_SCHEMAS, f"{path} holds a {family.name} model", setting,
                f"give a model of {kind} data")
        return Opened(path, family, family.schema(**settings), task_cls.DATA_SCHEMAS[task_cls.DATA_KIND](),
                      config["vocab_size"], True)
    step = resolve_step(path, setting, also="a Hugging Face model folder" if hf_folders else "")
    family, model_cfg, data_cfg = load_run(step, kind, list(data))
    vocab = (read_facts(step.parent.parent, TASK_FILE) or {}).get("vocab_size")
    return Opened(step, family, model_cfg, data_cfg, vocab, False,
                  None if step == path else f"reading {step} (from {path})")


def checkpoint_state(folder: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model entries of a checkpoint as full tensors (the optimizer's are not read), after checking that it
    holds `model`'s weights (a meta build is enough), no more, no fewer, of the same shapes."""
    import torch.distributed.checkpoint as dcp

    from utils.checkpoints.sharded_state import SafeReader, read_shapes

    wanted = {f"model/{k}": tuple(t.shape) for k, t in model.state_dict().items()}
    held = {k: s for k, s in read_shapes(folder).items() if k.startswith("model/")}
    wrong = sorted(k for k in wanted.keys() | held.keys() if wanted.get(k) != held.get(k))
    require(not wrong, f"{folder} holds another model ({len(wrong)} weights missing, extra or of other shapes, "
            f"e.g. {wrong[0] if wrong else ''})", "CHECKPOINT", "give a checkpoint of a run of this model")
    metadata = SafeReader(folder).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(shape, dtype=metadata[key].properties.dtype) for key, shape in held.items()}
    dcp.load(tensors, storage_reader=SafeReader(folder), no_dist=True)
    return {key.removeprefix("model/"): t for key, t in tensors.items()}


def assign(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`state`'s tensors as `model`'s parameters and buffers (no copy), the model's shared parameters (a tied head)
    shared again: `load_state_dict(assign=True)` gives each name its own."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    model.load_state_dict(state, assign=True)
    for first, *others in (n for n in names.values() if len(n) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
