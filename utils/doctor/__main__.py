"""`python -m utils.doctor`: see utils/doctor/run.py."""

import sys

from utils.doctor.run import main

sys.exit(main())
