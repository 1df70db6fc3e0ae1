"""The two training backends and what they share: the interface the loop drives (``interface``), the
rectified-flow objective, EMA, packed rows, and the step shapes both compile.

- ``jax/``: JAX/Flax NNX on TPU (and CPU): ``backend`` (state, sharding, checkpoints), ``step`` (the jitted
  step functions), ``compile`` (ahead-of-time compilation for tpu7x topologies).
- ``torch/``: PyTorch FSDP2 on GPU (and CPU): ``backend``, ``step``, ``compile`` (AOT checks for GPUs).
"""
