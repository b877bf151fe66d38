"""`python -m utils.comm tp=4 dp=2 order=tp-dp`: print a layout's rank groups (utils/plan/layout.py), launch nothing.

A module of its own so that the grid (utils/comm/__init__.py) imports nothing above it: this one sits
with the tools (tests/test_architecture.py LAYERS).
"""

import sys

from utils.startup import imports_done, pause_collector

pause_collector()  # until the imports are done (utils/startup.py)

from utils.plan.layout import main  # noqa: E402 - imported with the collector paused

imports_done()

sys.exit(main(sys.argv[1:]))
