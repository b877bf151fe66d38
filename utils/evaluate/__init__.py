"""Multiple-choice evaluation of a language model: `python -m utils.evaluate` (command.py), from a checkpoint of
any layout or a Hugging Face folder; items.py (the JSON Lines format), scoring.py (log-likelihoods, accuracy),
sharded.py (the model under tp and pp on a launch's ranks). A tool over utils.generate's loading, the engine's
build and the tasks' criteria.
"""
