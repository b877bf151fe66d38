"""The doctor for a first GPU node: `python -m utils.doctor [options] [overrides]` (docs/doctor.md).

In a few minutes on the node a job will use, with the job's own layout: the environment (report.py's
class 'environment', environment.py), collective bus bandwidth per axis group against the planner's assumed
links (bandwidth.py), every mapping against its adjoint (adjoints.py) and every parallel layer against its
serial twin (layers.py) in fp32 and bf16, the layout against the single-device curve and its throughput
(training.py). run.py is the command line and the launcher; report.py the verdicts, the report and the exit
status. The same code runs on CPU/gloo in the test suite; only a few lines are device-specific.
"""
