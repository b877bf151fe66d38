"""What the planner assumes of a run besides its layout, and where each assumption comes from (the header's
second line, `workload` in --json): a language model's vocabulary, the global batch and the tokens per sample.

Vocabulary. A run takes it from its tokenizer; the planner reads no data, so it takes, in this order:
`--vocab V`; the tokenizer the data config names and that can be read without the corpus (data=tokens: the
index.json of data.root; data.tokenizer=PATH: that tokenizer.json; data.tokenizer=bpe: data.bpe_vocab_size, the
most the BPE trained on the corpus has); the published tokenizer of the model preset (`PUBLISHED_VOCAB`:
llama_1b and llama_8b Llama 3's 128256, gpt_small and gpt_medium GPT-2's 50257); else GPT-2's 50257, the
language task's own default without data. data.tokenizer=word (the wikitext presets' default) counts the words
of the corpus, which the planner does not read: the header says so.

Global batch. `trainer.global_batch_size` as a run reads it. With `--world N`, when neither an override
(`trainer.global_batch_size=B`) nor an `experiment=` preset sets it, the one-process default (16 samples) is
CPU-sized: the planner plans N x that batch instead, the batch a data-parallel run keeps per rank when it
grows from one process to N (so every layout of N ranks, dp N included, can split it). Tokens per sample:
data.seq_len (a language model), data.img_size over model.patch_size (the ViT).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from utils import require

# model preset -> (vocabulary of the published model the preset is shaped after, whose tokenizer)
PUBLISHED_VOCAB = {"gpt_small": (50257, "GPT-2's"), "gpt_medium": (50257, "GPT-2's"),
                   "llama_1b": (128256, "Llama 3's"), "llama_8b": (128256, "Llama 3's")}
DEFAULT_VOCAB = 50257  # GPT-2's: the language task's vocabulary without data (utils/language/task/language.py)
BATCH = "trainer.global_batch_size"


@dataclass
class Workload:
    """The assumptions a plan is made under, each with where it comes from."""

    vocab: int | None  # None: the model reads no vocabulary (the ViT)
    vocab_from: str
    global_batch: int
    batch_from: str
    tokens_per_sample: int
    tokens_from: str
    settings: dict[str, int]  # what the planner sets on each layout's config (the --world batch)

    def line(self) -> str:
        vocab = f"vocabulary {self.vocab} ({self.vocab_from}); " if self.vocab else ""
        return (f"workload: {vocab}global batch {self.global_batch} ({self.batch_from}), "
                f"{self.tokens_per_sample} tokens per sample ({self.tokens_from})")

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "settings"}


def resolve_vocab(cfg, model_preset: str | None, flag: int | None) -> tuple[int | None, str]:
    """(vocabulary, where it comes from) of cfg's model (see the module docstring); (None, "") for a model that
    reads none (then --vocab is refused)."""
    from utils.language.data.tokens import TokensConfig
    from utils.tasks import build_task

    task = build_task(cfg, load_data=False)
    if not hasattr(task, "data_less_vocab"):
        require(flag is None, f"model={cfg.model.arch} reads no vocabulary", "--vocab", "leave --vocab out")
        return None, ""
    if flag is not None:
        return flag, "--vocab"
    data, unread = cfg.data, ""
    tokenizer = getattr(data, "tokenizer", "word")
    if isinstance(data, TokensConfig):
        if data.root:
            from pathlib import Path

            from utils.language.data.shards import read_index

            index = read_index(Path(data.root).expanduser())
            return index.vocab_size, f"the tokenizer of data.root's index.json, {index.tokenizer.get('name', '?')}"
        unread = "data=tokens without data.root"
    elif tokenizer == "bpe":
        return data.bpe_vocab_size, "data.bpe_vocab_size, the most the BPE trained on the corpus has"
    elif tokenizer != "word":
        from utils.language.data.tokenizers import PretrainedTokenizer

        return PretrainedTokenizer.load(tokenizer).vocab_size, f"data.tokenizer={tokenizer}"
    else:
        unread = "data.tokenizer=word counts the corpus's words, not read here"
    if model_preset in PUBLISHED_VOCAB:
        vocab, whose = PUBLISHED_VOCAB[model_preset]
        return vocab, f"model={model_preset}: {whose} published tokenizer; {unread}; --vocab V sets it"
    return DEFAULT_VOCAB, f"GPT-2's, the default: model={model_preset} names no tokenizer, {unread}; --vocab V sets it"


def batch_set_by(configs) -> str:
    """What sets the global batch of LayoutConfigs `configs`: its override, an experiment preset, or "" (the
    schema's default)."""
    for arg in configs.overrides:
        if arg.lstrip("+~").split("=")[0] == BATCH:
            return arg
    experiment = configs.choices.get("experiment")
    return f"experiment={experiment}" if experiment not in (None, "null", "None") else ""


def workload(configs, world: int = 0) -> Workload:
    """The assumptions of a plan of `configs` (a LayoutConfigs) on `world` ranks (0: the layout its overrides
    give, at its configured batch)."""
    from utils.tasks import build_task

    cfg = configs.load({})
    batch, set_by, settings = cfg.trainer.global_batch_size, batch_set_by(configs), {}
    if set_by:
        batch_from = set_by
    elif world:
        settings = {BATCH: world * batch}
        batch_from = (f"--world {world} x {batch}, the one-process default per rank: {BATCH} unset; "
                      f"set it to plan another")
        batch = world * batch
    else:
        batch_from = f"{BATCH}, its default"
    tokens = build_task(cfg, load_data=False).tokens_per_sample()
    tokens_from = ("data.seq_len" if hasattr(cfg.data, "seq_len") else
                   "data.img_size / model.patch_size" if hasattr(cfg.model, "patch_size") else "the task's")
    return Workload(configs.vocab, configs.vocab_from, batch, batch_from, tokens, tokens_from, settings)
