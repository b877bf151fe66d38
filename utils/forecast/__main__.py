"""`python -m utils.forecast`: see utils/forecast/report.py."""

from utils.startup import run_tool

run_tool("utils.forecast.report")
