"""The language wing: text readers and token shards behind the text source interface (data/: text.py), the
language-model task with greedy decoding and sampling (task/). Its commands keep the names users run:
`python -m utils.generate`, `python -m utils.evaluate` (utils/generate/, utils/evaluate/) and
`python -m utils.data.prepare`. The core names none of it: the families name the task ("language"), found in
task/__init__.py's TASKS, and the task names its sources (`DATA_SCHEMAS`)."""
