"""The Llama family (`model=llama_*`): the decoder (networks/transformer.py) with Llama's choices (`LlamaConfig`),
exchanged with Hugging Face's LlamaForCausalLM (hf.py)."""

from networks.llama.hf import LlamaExchange
from networks.spec import ModelSpec
from networks.transformer import GPT, LlamaConfig, check_layout


def _build(cfg: LlamaConfig, task) -> GPT:
    return GPT(cfg, task.vocab_size)


FAMILY = ModelSpec(arch="llama", name="Llama", schema=LlamaConfig, presets="model=llama_tiny, llama_1b or llama_8b",
                   tiny="llama_tiny", task="language", build=_build, blocks=lambda cfg: cfg.depth,
                   check_layout=check_layout, documents=True, decodes=True, hf=LlamaExchange())
