"""`python -m utils.generate`: see utils/generate/command.py."""

import sys

from utils.generate.command import main

sys.exit(main())
