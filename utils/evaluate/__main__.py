"""`python -m utils.evaluate`: see utils/evaluate/command.py."""

import sys

from utils.evaluate.command import main

sys.exit(main())
