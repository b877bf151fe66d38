"""`python -m utils.compare`: see utils/compare/report.py."""

from utils.startup import run_tool

run_tool("utils.compare.report")
