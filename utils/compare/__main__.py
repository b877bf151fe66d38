"""`python -m utils.compare`: see utils/compare/report.py."""

import sys

from utils.compare.report import main

sys.exit(main())
