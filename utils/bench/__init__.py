"""The benchmark: `python -m utils.bench` times the real train step (train_step) beside the NERSC tutorial's
ViT at the same shape (seed_step, run by its own interpreter); at tp > 1, against the tutorial's model-parallel
ViT with sequence parallelism on and off (versus_seed). `python -m utils.bench.collectives` times the
collectives tensor and sequence parallelism use, per backend.
"""
