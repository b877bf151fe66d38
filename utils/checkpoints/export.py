"""`python -m utils.checkpoints.export ...`: the conversion command's former name, kept for users' scripts; the
command is `python -m utils.export` (utils/export/convert.py). A tool, not part of the checkpoint layer
(tests/test_architecture.py LAYERS places it with the tools)."""

import sys

from utils.export.convert import main

if __name__ == "__main__":
    sys.exit(main())
