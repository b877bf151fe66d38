"""`python -m utils.generate`: see utils/generate/command.py."""

from utils.startup import run_tool

run_tool("utils.generate.command")
