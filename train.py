"""Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

A script over utils/cli/entry.py (the command line, `--help`) and utils/cli/local_launch.py (one run, here or as
the local ranks of its layout). `import train; train.main(argv)` runs the command line in this process.
"""

import sys

from utils.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
