"""The forecast command: `python -m utils.forecast CHECKPOINT` (report.py: rollouts, files, metrics, figures)."""
