"""Text sampled from a language model: `python -m utils.generate` (command.py), from a checkpoint of any layout
or a Hugging Face folder, with the run's tokenizer; a tool over the checkpoints, the data's tokenizers and the
sampling loop of utils/language/task/sampling.py.
"""
