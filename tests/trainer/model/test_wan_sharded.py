"""Placement on a real 8-device mesh: streamed loading and random init put each parameter where the rule says,
and the sharded model computes what the single-device one does.

JAX fixes its CPU device count at import, so the mesh checks run in a fresh interpreter with
``--xla_force_host_platform_device_count=8``; the checkpoint is written here by diffusers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from wanloom_trainer.config.variants import get_variant

MESH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from wanloom_trainer.config.variants import get_variant
    from wanloom_trainer.model.load import load_diffusers_transformer
    from wanloom_trainer.model.params import param_name
    from wanloom_trainer.model.wan_jax import init_model

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    variant = get_variant("tiny")

    def rule(name, abstract):
        # FSDP-style: shard the first axis of matrices over "fsdp" when it divides; replicate the rest.
        if abstract.ndim == 2 and abstract.shape[0] % 4 == 0:
            return NamedSharding(mesh, P("fsdp", None))
        return NamedSharding(mesh, P())

    def params(model):
        return {param_name(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def check_placement(model, reference, what):
        sharded = 0
        for name, value in params(model).items():
            want = rule(name, value)
            assert value.sharding == want, (what, name, value.sharding, want)
            if want.spec == P("fsdp", None):
                sharded += 1
                assert value.addressable_shards[0].data.shape[0] == value.shape[0] // 4, (what, name)
            np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[name]), err_msg=f"{what} {name}")
        assert sharded > 20, (what, sharded)

    folder = sys.argv[1]
    plain = load_diffusers_transformer(folder, variant)
    loaded = load_diffusers_transformer(folder, variant, shardings=rule)
    check_placement(loaded, params(plain), "load")
    check_placement(init_model(variant, seed=3, shardings=rule), params(init_model(variant, seed=3)), "init")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 3, 6, 10)).astype(np.float32)
    t = np.asarray([999.0, 11.5], np.float32)
    context = rng.standard_normal((2, 7, 32)).astype(np.float32)
    forward = nnx.jit(lambda m, *a: m(*a))
    want = np.asarray(forward(plain, x, t, context))
    batch = NamedSharding(mesh, P("data"))
    got = np.asarray(forward(loaded, *(jax.device_put(a, batch) for a in (x, t, context))))
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error < 1e-5, error

    names = list(params(plain))
    partial = {name: NamedSharding(mesh, P()) for name in names[1:]}
    try:
        load_diffusers_transformer(folder, variant, shardings=partial)
    except KeyError as err:
        assert names[0] in str(err), err
    else:
        raise AssertionError("a mapping without every parameter must be rejected")
    print("MESH-OK", error)
    """
)


def test_load_and_init_place_parameters_on_an_8_device_mesh(make_checkpoint, tmp_path: Path) -> None:
    _, folder = make_checkpoint(get_variant("tiny"), seed=5)
    script = tmp_path / "mesh_check.py"
    script.write_text(MESH_SCRIPT)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "operator"), str(root / "trainer_images")])}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(script), str(folder)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MESH-OK" in result.stdout
