"""Checkpoints in one place: the durable save and resume protocol (checkpointer), the sharded state
views DCP writes and reads under any layout (sharded_state), and export to and from one file (export:
`python -m utils.checkpoints.export`).
"""
