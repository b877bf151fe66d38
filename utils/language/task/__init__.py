"""The language wing's task (language.py), greedy decoding (generate.py) and sampling with a KV cache (sampling.py).
`TASKS` is how the core finds it (utils/tasks/__init__.py `tasks`)."""

from utils.language.task.language import LanguageTask

TASKS = {"language": LanguageTask}
