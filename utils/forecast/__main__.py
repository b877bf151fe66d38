"""`python -m utils.forecast`: see utils/forecast/report.py."""

import sys

from utils.startup import imports_done, pause_collector

pause_collector()  # until the imports are done (utils/startup.py)

from utils.forecast.report import main  # noqa: E402 - imported with the collector paused

imports_done()

sys.exit(main())
