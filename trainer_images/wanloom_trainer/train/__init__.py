"""Training: the backend-agnostic driver (``run``), the Backend protocol (``backend``), the shared objective and
schedule, and one backend per framework (``backend_jax``, ``backend_torch``). Nothing heavy is imported here."""
