"""Video tokenizers: frame sampling, the per-patch codebook and the H.264 packet kinds."""
