"""The planner: `python -m utils.plan` predicts memory, bytes and step time per layout (cost_model), and
prints a layout's rank groups (layout: `python -m utils.plan.layout`).
"""
