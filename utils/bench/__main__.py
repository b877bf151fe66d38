"""`python -m utils.bench`: see utils/bench/train_step.py."""

import sys

from utils.bench.train_step import main

sys.exit(main())
