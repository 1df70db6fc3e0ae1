"""Named sharding rules of the JAX trainer (pure rules here; the sharded step runs in test_sharded_step.py)."""

from __future__ import annotations

import pytest

from wanloom_trainer.config.train_config import ParallelConfig
from wanloom_trainer.parallel.mesh_jax import param_partition


@pytest.mark.parametrize(
    ("name", "shape", "fsdp", "tensor", "expected"),
    [
        ("blocks.0.attn1.to_q.kernel", (32, 32), 4, 2, ("fsdp", "tensor")),  # column parallel: out over tensor
        ("blocks.0.attn1.to_out.0.kernel", (32, 32), 4, 2, ("tensor", "fsdp")),  # row parallel: in over tensor
        ("blocks.0.ffn.net.0.proj.kernel", (32, 64), 4, 2, ("fsdp", "tensor")),
        ("blocks.0.ffn.net.2.kernel", (64, 32), 4, 2, ("tensor", "fsdp")),
        ("blocks.0.attn1.to_q.bias", (32,), 4, 2, ("tensor",)),
        ("blocks.0.attn1.norm_q.scale", (32,), 4, 2, ("fsdp",)),  # norms: no tensor split, FSDP only
        ("blocks.0.scale_shift_table", (1, 6, 32), 4, 1, (None, None, "fsdp")),  # the largest divisible dim
        ("proj_out.kernel", (32, 6), 4, 1, ("fsdp", None)),
        ("patch_embedding.bias", (30,), 4, 1, (None,)),  # not divisible: replicated
        ("blocks.0.attn1.to_q.kernel", (32, 32), 1, 1, (None, None)),
    ],
    ids=lambda v: str(v) if isinstance(v, tuple) else None,
)
def test_param_partition(name: str, shape: tuple, fsdp: int, tensor: int, expected: tuple) -> None:
    assert param_partition(name, shape, fsdp, tensor) == expected


def test_mesh_must_match_the_device_count() -> None:
    import jax

    from wanloom_trainer.parallel.mesh_jax import build_mesh

    with pytest.raises(ValueError, match=r"= 2 devices, but JAX sees 1"):
        build_mesh(ParallelConfig(1, 2, 1, 1), devices=jax.devices()[:1])
    mesh = build_mesh(ParallelConfig(1, 1, 1, 1), devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
