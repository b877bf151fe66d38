"""`python -m utils.forecast`: see utils/forecast/report.py."""

import sys

from utils.forecast.report import main

sys.exit(main())
