"""`python -m utils.export`: see utils/export/convert.py."""

import sys

from utils.export.convert import main

sys.exit(main())
