"""The command-line front: the config tree and its composition, train.py's command line and Hydra's,
the launch environment, local multi-process launch, run directories.
"""
