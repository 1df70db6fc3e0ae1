"""The PyTorch backend: ``backend.TorchBackend``, its step functions and its AOT checks."""
