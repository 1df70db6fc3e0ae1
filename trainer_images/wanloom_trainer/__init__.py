"""wanloom trainer: Wan 2.2 joint two-expert training on JAX (TPU) and PyTorch (GPU).

Importing this package pulls in nothing heavy: jax, torch and the data libraries are imported by the modules that
need them.
"""
