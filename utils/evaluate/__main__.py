"""`python -m utils.evaluate`: see utils/evaluate/command.py."""

from utils.startup import run_tool

run_tool("utils.evaluate.command")
