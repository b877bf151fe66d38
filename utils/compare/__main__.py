"""`python -m utils.compare`: see utils/compare/report.py."""

import sys

from utils.startup import imports_done, pause_collector

pause_collector()  # until the imports are done (utils/startup.py)

from utils.compare.report import main  # noqa: E402 - imported with the collector paused

imports_done()

sys.exit(main())
