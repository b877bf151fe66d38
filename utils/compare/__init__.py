"""Runs side by side: `python -m utils.compare RUN...` (report: the table, CSV and figures), and where two
runs part: `python -m utils.compare --diverge RUN_A RUN_B` (diverge: the first step, pass and module).
"""
