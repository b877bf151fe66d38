"""`python -m utils.comm tp=4 dp=2 order=tp-dp`: print a layout's rank groups (utils/plan/layout.py), launch nothing.

The command DESIGN.md names; a module of its own so that the grid (utils/comm/__init__.py) imports nothing above
it: this one sits with the tools (tests/test_architecture.py LAYERS).
"""

import sys

from utils.plan.layout import main

sys.exit(main(sys.argv[1:]))
