"""Checkpoints: orbax for the JAX trainer (``orbax_checkpoint``), torch DCP for the PyTorch trainer."""
