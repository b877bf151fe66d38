"""Checkpoints in one place: the durable save and resume protocol (checkpointer), the sharded state
views DCP writes and reads under any layout (sharded_state), Hugging Face folders (hf, hf_stream), and the
run directory they lie in (run_dir: its name, safe resumption, the run facts). The conversion to and from one
file is a tool over them (`python -m utils.export`).
"""
