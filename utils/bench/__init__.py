"""The benchmark: `python -m utils.bench` times the real train step (train_step) beside the NERSC tutorial's
ViT at the same shape (seed_step, run by its own interpreter).
"""
