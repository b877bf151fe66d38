"""`python -m utils.plan`: see utils/plan/cost_model.py."""

import sys

from utils.plan.cost_model import main

sys.exit(main())
