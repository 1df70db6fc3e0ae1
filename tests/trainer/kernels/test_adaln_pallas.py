"""Pallas AdaLN vs the plain jnp chain: outputs and every gradient, on CPU with ``interpret=True``.

Error metric as in test_adaln_triton.py: ``max|got − want| / max(1, max|want|)`` for float32 x (≤ 1e-5) and
``max|got − want| / max|want|`` for bfloat16 x (≤ 2e-2).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from wanloom_trainer.kernels import adaln_jax
from wanloom_trainer.kernels import adaln_pallas as pallas_mod
from wanloom_trainer.kernels.adaln_pallas import adaln_pallas
from wanloom_trainer.kernels.adaln_ref_jax import adaln_reference_jax

TOL = {"f32": 1e-5, "bf16": 2e-2}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}

# Every call compiles the interpreted kernels (~1 s), so the default run is a covering subset of the grid
# (each D with both modulations, both dtypes, B in {1, 3}, N in {1, 17, 4096}, D = 64/96 not a multiple of 128);
# the full grid is marked exhaustive (deselected by default; `make test-exhaustive` runs it).
GRID = list(itertools.product((64, 96, 3072, 5120), (1, 17, 4096), (1, 3), ("sample", "token"), ("f32", "bf16")))
DEFAULT = [
    (64, 1, 3, "sample", "f32"),
    (64, 4096, 1, "token", "bf16"),
    (96, 17, 3, "sample", "bf16"),
    (96, 4096, 3, "sample", "f32"),
    (3072, 17, 3, "token", "bf16"),
    (3072, 1, 1, "sample", "f32"),
    (5120, 17, 3, "sample", "f32"),
    (5120, 1, 1, "token", "bf16"),
]


def _close(got: jax.Array, want: jax.Array, dtype: str) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    floor = 1.0 if dtype == "f32" else 1e-30
    return float(np.abs(got - want).max() / max(floor, np.abs(want).max()))


def _inputs(b: int, n: int, d: int, mod: str, dtype: str, mod_dtype=jnp.float32, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (b, n, d) if mod == "token" else (b, d)
    x = (2 * jax.random.normal(keys[0], (b, n, d)) + 0.5).astype(DTYPES[dtype])
    scale = (0.3 * jax.random.normal(keys[1], shape)).astype(mod_dtype)
    shift = jax.random.normal(keys[2], shape).astype(mod_dtype)
    return x, scale, shift, jax.random.normal(keys[3], (b, n, d)).astype(DTYPES[dtype])


def _run(fn, x, scale, shift, dy):
    y, pullback = jax.vjp(fn, x, scale, shift)
    return [y, *pullback(dy)]


def _case_param(case: tuple) -> object:
    return pytest.param(*case, id="-".join(map(str, case)), marks=[] if case in DEFAULT else [pytest.mark.exhaustive])


@pytest.mark.parametrize(("d", "n", "b", "mod", "dtype"), [_case_param(c) for c in GRID])
def test_matches_reference(d: int, n: int, b: int, mod: str, dtype: str) -> None:
    x, scale, shift, dy = _inputs(b, n, d, mod, dtype)
    got = _run(adaln_pallas, x, scale, shift, dy)
    want = _run(adaln_reference_jax, x, scale, shift, dy)
    for name, g, w in zip(("y", "dx", "d_scale", "d_shift"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _close(g, w, dtype) <= TOL[dtype], f"{name}: error {_close(g, w, dtype):.2e}"


@pytest.mark.parametrize("mod", ["sample", "token"])
def test_partial_last_block_is_masked_under_tpu_interpreter(mod: str) -> None:
    """N = 17 with tn = 8: the third block is partial. The TPU-faithful interpreter fills reads past the end with
    NaN, so any unmasked row would poison d_scale/d_shift."""
    nan_reads = pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    x, scale, shift, dy = _inputs(3, 17, 96, mod, "f32")
    got = _run(lambda *a: adaln_pallas(*a, interpret=nan_reads, block_rows=8), x, scale, shift, dy)
    want = _run(adaln_reference_jax, x, scale, shift, dy)
    assert all(_close(g, w, "f32") <= 1e-5 for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("block_rows", [8, 64])
def test_result_does_not_depend_on_block_rows(block_rows: int) -> None:
    x, scale, shift, dy = _inputs(3, 100, 256, "sample", "f32")
    got = _run(lambda *a: adaln_pallas(*a, block_rows=block_rows), x, scale, shift, dy)
    want = _run(adaln_reference_jax, x, scale, shift, dy)
    assert all(_close(g, w, "f32") <= 1e-5 for g, w in zip(got, want, strict=True))


def _segment_inputs(b: int, n: int, d: int, segments: int, dtype: str, seed: int = 0):
    """Packed rows: sorted random ids (some segments empty, some rows starting past id 0), modulation [B, S, D]."""
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.sort(rng.integers(1, segments, (b, n)), axis=1), jnp.int32)
    x, _, _, dy = _inputs(b, n, d, "sample", dtype, seed=seed)
    scale = jnp.asarray(0.3 * rng.standard_normal((b, segments, d)), jnp.float32)
    shift = jnp.asarray(rng.standard_normal((b, segments, d)), jnp.float32)
    return x, scale, shift, dy, ids


@pytest.mark.parametrize(
    ("b", "n", "d", "segments", "dtype", "block_rows"),
    [(2, 300, 96, 4, "f32", None), (1, 1000, 256, 7, "bf16", 128), (2, 129, 5120, 3, "f32", None)],
)
def test_packed_segments_match_reference(b: int, n: int, d: int, segments: int, dtype: str, block_rows) -> None:
    """Per-segment modulation gathered by one-hot products, per-segment d_scale/d_shift accumulated across blocks
    (segments straddle blocks; N not a multiple of tn; an id never used gets exact zeros)."""
    x, scale, shift, dy, ids = _segment_inputs(b, n, d, segments, dtype)
    got = _run(lambda *a: adaln_pallas(*a, block_rows=block_rows, segment_ids=ids), x, scale, shift, dy)
    want = _run(lambda *a: adaln_reference_jax(*a, segment_ids=ids), x, scale, shift, dy)
    for name, g, w in zip(("y", "dx", "d_scale", "d_shift"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _close(g, w, dtype) <= TOL[dtype], f"{name}: error {_close(g, w, dtype):.2e}"
    assert not np.asarray(got[2][:, 0]).any()  # segment 0 holds no token: its gradient is exactly 0


def test_one_segment_per_row_equals_per_sample_modulation() -> None:
    x, scale, shift, dy = _inputs(3, 200, 128, "sample", "f32")
    ids = jnp.zeros((3, 200), jnp.int32)
    packed = _run(lambda x, s, h: adaln_pallas(x, s[:, None], h[:, None], segment_ids=ids), x, scale, shift, dy)
    plain = _run(adaln_pallas, x, scale, shift, dy)
    for g, w in zip(packed, plain, strict=True):
        assert _close(g, w, "f32") <= 1e-6


def test_jit_grad_and_input_dtypes() -> None:
    x, scale, shift, dy = _inputs(2, 17, 96, "sample", "bf16", mod_dtype=jnp.float32)
    shift = shift.astype(jnp.bfloat16)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dy.astype(jnp.float32))
    got = jax.jit(jax.grad(loss(adaln_pallas), argnums=(0, 1, 2)))(x, scale, shift)
    want = jax.grad(loss(adaln_reference_jax), argnums=(0, 1, 2))(x, scale, shift)
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.float32, jnp.bfloat16]
    assert all(_close(g, w, "bf16") <= 2e-2 for g, w in zip(got, want, strict=True))


def test_b1d_modulation_and_dispatch() -> None:
    x, scale, shift, dy = _inputs(2, 17, 128, "sample", "f32")
    scale, shift = scale[:, None], shift[:, None]
    fused = _run(lambda *a: adaln_jax(*a, impl="fused"), x, scale, shift, dy)
    ref = _run(lambda *a: adaln_jax(*a, impl="reference"), x, scale, shift, dy)
    assert fused[2].shape == (2, 1, 128)
    assert all(_close(g, w, "f32") <= 1e-5 for g, w in zip(fused, ref, strict=True))
    with pytest.raises(ValueError, match="unknown impl 'pallas'; valid: fused, reference"):
        adaln_jax(x, scale, shift, impl="pallas")


def test_bad_input_raises_naming_it() -> None:
    x, scale, shift, _ = _inputs(3, 17, 96, "sample", "bf16")
    with pytest.raises(ValueError, match=r"scale/shift shape \[2, 96\] does not fit x \[3, 17, 96\]"):
        adaln_pallas(x, scale[:2], shift[:2])
    with pytest.raises(ValueError, match="shift dtype float16 is not supported with x in bfloat16"):
        adaln_pallas(x, scale, shift.astype(jnp.float16))
    with pytest.raises(ValueError, match="block_rows must be a positive multiple of 16 for x in bfloat16, got 8"):
        adaln_pallas(x, scale, shift, block_rows=8)
    with pytest.raises(ValueError, match="eps must be > 0"):
        adaln_pallas(x, scale, shift, eps=0.0)
    with pytest.raises(ValueError, match=r"with segment_ids, scale/shift must be per segment \[3, S, 96\]"):
        adaln_pallas(x, scale, shift, segment_ids=jnp.zeros((3, 17), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be int32 or int64, got float32"):
        adaln_pallas(x, scale[:, None], shift[:, None], segment_ids=jnp.zeros((3, 17), jnp.float32))


def test_interpret_defaults_to_true_off_tpu() -> None:
    assert pallas_mod._default_interpret() is (jax.default_backend() != "tpu")


_SHARD_MAP_CHECK = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, PartitionSpec as P
    from wanloom_trainer.kernels.adaln_pallas import adaln_pallas
    from wanloom_trainer.kernels.adaln_ref_jax import adaln_reference_jax

    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 4)
    x, dy = jax.random.normal(keys[0], (2, 34, 96)), jax.random.normal(keys[3], (2, 34, 96))
    for shape, spec in (((2, 96), P("data", None)), ((2, 34, 96), P("data", "seq", None))):
        scale, shift = 0.3 * jax.random.normal(keys[1], shape), jax.random.normal(keys[2], shape)
        row = P("data", "seq", None)
        sharded = jax.shard_map(adaln_pallas, mesh=mesh, in_specs=(row, spec, spec), out_specs=row, check_vma=False)
        loss = lambda f: lambda *a: jnp.sum(f(*a) * dy)
        got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(x, scale, shift)
        want = jax.value_and_grad(loss(adaln_reference_jax), argnums=(0, 1, 2))(x, scale, shift)
        errors = [float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(jax.tree.leaves(got),
                                                                                    jax.tree.leaves(want))]
        assert max(errors) < 1e-4, (shape, errors)
        print("ok", shape)
""")


def test_under_shard_map_with_sharded_sequence() -> None:
    """4 CPU devices (data x seq): per-sample d_scale must be summed over the sequence shards."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _SHARD_MAP_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "(2,", "96)", "ok", "(2,", "34,", "96)"]
