"""`python -m utils.plan`: see utils/plan/cost_model.py."""

from utils.startup import run_tool

run_tool("utils.plan.cost_model")
