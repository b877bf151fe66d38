"""`python -m utils.comm tp=4 dp=2 order=tp-dp`: print a layout's rank groups (utils/plan/layout.py), launch nothing.

The printer is a tool's (utils/plan/layout.py), named here only as text (utils/startup.py `run_tool`): the grid's
folder imports nothing above its layer.
"""

import sys

from utils.startup import run_tool

run_tool("utils.plan.layout", sys.argv[1:])
