"""The tests-only family as a family module (utils/tasks/registry.py's contract): its spec and its preset
(`model=toy_tiny`), read by the registry, not registered on import. `DLSCALE_FAMILIES=tests.toy_family python
train.py model=toy_tiny data=wikitext_sample` trains it; tests add it in their process with
`utils.tasks.registry.add_modules(["tests.toy_family"])`."""

from networks.layout import check_heads
from networks.spec import ModelSpec
from tests.toy_family.hf import ToyExchange
from tests.toy_family.model import ToyConfig, ToyLM
from utils.language.task.language import LanguageTask


def _build(cfg: ToyConfig, task: LanguageTask) -> ToyLM:
    return ToyLM(cfg, task.vocab_size)


FAMILY = ModelSpec(arch="toy", name="toy decoder", schema=ToyConfig, presets="model=toy_tiny", tiny="toy_tiny",
                   task=LanguageTask, build=_build, blocks=lambda cfg: cfg.depth,
                   check_layout=lambda cfg, parallel: check_heads(cfg.num_heads, parallel), hf=ToyExchange())
PRESETS = {"toy_tiny": ToyConfig}
