"""`python -m utils.bench`: see utils/bench/train_step.py."""

from utils.startup import run_tool

run_tool("utils.bench.train_step")
