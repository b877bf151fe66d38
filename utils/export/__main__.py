"""`python -m utils.export`: see utils/export/convert.py."""

from utils.startup import run_tool

run_tool("utils.export.convert")
