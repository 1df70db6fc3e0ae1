"""Generating videos with the experts being trained: the sampler (``sampler``), the VAE decode and the files a
researcher looks at (``media``). The training loop calls it through ``evaluation.samples``; the framework stays behind
``Backend.predict``, so this package is numpy except for the PyTorch VAE."""
