"""Shapes and sizes: buckets, tokens per latent shape, the sample shape index and the per-bucket batch sizes."""
