"""Device meshes, sharding rules and sharded attention (JAX ``mesh``/``context_attention``; PyTorch ``*_torch``)."""
