"""`python -m utils.evaluate`: see utils/evaluate/command.py."""

import sys

from utils.startup import imports_done, pause_collector

pause_collector()  # until the imports are done (utils/startup.py)

from utils.evaluate.command import main  # noqa: E402 - imported with the collector paused

imports_done()

sys.exit(main())
