"""`python -m utils.doctor`: see utils/doctor/run.py."""

from utils.startup import run_tool

run_tool("utils.doctor.run")
