"""Tensor parallelism: column/row parallel layers, the vocabulary-parallel embedding and loss, and the
parallelize step that swaps the serial layers a model declares for them."""
