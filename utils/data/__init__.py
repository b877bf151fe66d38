"""Data readers: ERA5 (NERSC layout, and a synthetic generator) and WikiText (corpus, tokenizers, cache), and
the batching that gives each dp rank its part of the same global batch."""
