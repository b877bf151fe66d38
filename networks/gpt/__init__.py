"""The GPT family (`model=gpt_*`): the decoder (networks/transformer.py) with GPT-2's choices, exchanged with
Hugging Face's GPT2LMHeadModel (hf.py)."""

from networks.gpt.hf import GPT2Exchange
from networks.spec import ModelSpec
from networks.transformer import GPT, GPTConfig, check_layout


def _build(cfg: GPTConfig, task) -> GPT:
    return GPT(cfg, task.vocab_size)


FAMILY = ModelSpec(arch="gpt", name="GPT", schema=GPTConfig, presets="model=gpt_tiny, gpt_small or gpt_medium",
                   tiny="gpt_tiny", task="language", build=_build, blocks=lambda cfg: cfg.depth,
                   check_layout=check_layout, documents=True, decodes=True, hf=GPT2Exchange())
