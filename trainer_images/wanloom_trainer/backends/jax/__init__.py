"""The JAX backend: ``backend.JaxBackend``, its step functions and its AOT compiler."""
