"""Block-diagonal attention over packed rows: the splash kernel with run-time block skipping (Pallas interpreter
here) against the XLA reference, its block tables, and its Mosaic compilation for a tpu7x device.

Tolerance: both cores compute in float32 with the same inputs; they differ only in summation order (online softmax
over 128-wide blocks vs one softmax), so values and gradients agree to ~1e-6 relative; 1e-5 leaves a margin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wanloom_trainer.model.segment_attention import (
    Segments,
    kv_steps,
    segment_mask_infos,
    splash_segment_attention,
    xla_segment_attention,
)

TOL = 1e-5


def _ids(*lengths: int) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


def _qkv(b: int, q_len: int, kv_len: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, q_len, 2, 64))
    k, v = (rng.standard_normal((b, kv_len, 2, 64)) for _ in range(2))
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v))


def _value_and_grads(core, q, k, v, segments):
    loss = lambda q, k, v: jnp.sum(jnp.sin(core(q, k, v, segments)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _compare(segments: Segments, q, k, v) -> None:
    splash = lambda *a: splash_segment_attention(*a, block_q=128, block_kv=128, interpret=True)
    want_value, want_grads = _value_and_grads(xla_segment_attention, q, k, v, segments)
    got_value, got_grads = _value_and_grads(splash, q, k, v, segments)
    np.testing.assert_allclose(got_value, want_value, rtol=TOL)
    for name, got, want in zip("qkv", got_grads, want_grads, strict=True):
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        assert err < TOL, (name, err)


def test_packed_self_attention_matches_the_reference() -> None:
    # Segments straddle 128-token blocks; the second row has a different packing (one compiled program serves both);
    # 840 tokens are padded to 896 inside the kernel.
    ids = np.stack([_ids(300, 150, 70, 120, 200), _ids(600, 100, 140)])
    _compare(Segments(jnp.asarray(ids), jnp.asarray(ids), max_tokens=600), *_qkv(2, 840, 840))


def test_packed_cross_attention_matches_the_reference() -> None:
    # Each segment (padding included) attends only to its own 16 text tokens; row 2 gives three text blocks to its
    # last segment. Text segments with no local query (context parallelism) get zero key gradients.
    q_ids = np.stack([_ids(300, 150, 70, 120, 200), _ids(600, 100, 140, 0, 0)])
    kv_ids = np.stack([np.repeat(np.arange(5), 16), np.repeat([0, 1, 2, 2, 2], 16)]).astype(np.int32)
    q, _, _ = _qkv(2, 840, 80, seed=1)
    _, k, v = _qkv(2, 840, 80, seed=2)
    _compare(Segments(jnp.asarray(q_ids), jnp.asarray(kv_ids), max_tokens=600), q, k, v)


def test_block_tables_cover_exactly_the_blocks_that_share_a_segment() -> None:
    ids = _ids(300, 150, 70, 120, 200, 1208)  # 2048 tokens, 16 blocks of 128
    fwd, dkv = segment_mask_infos(jnp.asarray(ids), jnp.asarray(ids), 128, 128, max_tokens=1208)
    block_seg = ids.reshape(16, 128)
    needed = {(i, j) for i in range(16) for j in range(16) if np.intersect1d(block_seg[i], block_seg[j]).size}
    steps, steps_t = fwd.data_next.shape[2], dkv.data_next.shape[1]
    computed = {(i, int(fwd.data_next[0, i, s])) for i in range(16) for s in range(steps) if fwd.block_mask[0, i, s]}
    assert computed == needed  # contiguous segments: a q block's kv range holds only blocks it shares ids with
    dkv_next, dkv_mask = dkv.data_next[0], dkv.block_mask[0]
    computed_t = {(int(dkv_next[s, j]), j) for j in range(16) for s in range(steps_t) if dkv_mask[s, j]}
    assert computed_t == needed
    assert len(needed) < 0.6 * 16 * 16  # the point: most of the 16 x 16 grid is skipped


def test_grid_width_follows_the_longest_segment() -> None:
    assert kv_steps(75_776, 75_776, 512, 512, max_tokens=3_600) == 17  # images: 17 of 148 kv blocks per q block
    assert kv_steps(75_776, 75_776, 512, 512, max_tokens=75_600) == 148  # one long clip: every block
    assert kv_steps(4096, 4096, 512, 512, max_tokens=0) == 8  # no bound: no shrinking


@pytest.mark.slow
def test_segment_kernels_compile_with_mosaic_for_a_tpu7x_device() -> None:
    """Both packed kernels (splash with block tables built in the graph, AdaLN with per-segment modulation),
    forward and backward, lowered by Mosaic for one TPU7x TensorCore: a CPU run of the interpreter cannot show this."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from wanloom_trainer.kernels.adaln_pallas import adaln_pallas
        from wanloom_trainer.model.segment_attention import Segments, splash_segment_attention

        device = topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices[0]
        one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
        n = 4096

        def adaln(x, scale, shift, ids):
            return jnp.sum(adaln_pallas(x, scale, shift, 1e-6, False, segment_ids=ids).astype(jnp.float32))

        def attention(q, k, v, ids):
            out = splash_segment_attention(q, k, v, Segments(ids, ids, max_tokens=1024), interpret=False)
            return jnp.sum(out.astype(jnp.float32))

        ids = spec((1, n), jnp.int32)
        mods = [spec((1, 5, 5120), jnp.float32)] * 2
        for name, fn, args in (
            ("adaln", adaln, [spec((1, n, 5120), jnp.bfloat16), *mods, ids]),
            ("attention", attention, [spec((1, n, 4, 128), jnp.bfloat16)] * 3 + [ids]),
        ):
            hlo = jax.jit(jax.value_and_grad(fn, (0, 1, 2))).lower(*args).compile().as_text()
            print(name, hlo.count("tpu_custom_call"))
        """
    )
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(line.split() for line in run.stdout.splitlines())
    assert counts == {"adaln": "2", "attention": "3"}  # forward + backward; forward + dq + dkv
