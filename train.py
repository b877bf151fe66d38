"""Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

A script over utils/entry.py (the command line, `--help`) and utils/local_launch.py (one run, here or as
the local ranks of its layout). `import train; train.main(argv)` runs the command line in this process.
"""

import sys

from utils.entry import main

if __name__ == "__main__":
    sys.exit(main())
