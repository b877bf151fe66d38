"""The tests-only family's one registry line and its preset (`model=toy_tiny`), from its own folder."""

from hydra.core.config_store import ConfigStore

from networks.spec import ModelSpec
from tests.toy_family.model import ToyConfig, ToyLM
from utils.tasks.language import LanguageTask
from utils.tasks.registry import register

register(ModelSpec("toy", "toy decoder", ToyConfig, "model=toy_tiny", LanguageTask,
                   lambda cfg, task: ToyLM(cfg, task.vocab_size)))
ConfigStore.instance().store(group="model", name="toy_tiny", node=ToyConfig)
