"""Runs side by side: `python -m utils.compare RUN...` (report: the table, CSV and figures).
"""
