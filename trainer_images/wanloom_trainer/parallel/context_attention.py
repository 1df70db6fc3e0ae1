"""Attention that stays exact when the video sequence is split over the mesh's ``context`` axis.

Each device holds a slice of the queries [b, S/c, n, h] and of the keys/values. Inside ``shard_map`` the keys and
values are all-gathered over ``context`` (K/V are much smaller than the attention matrix, and Wan's attention has no
mask), each device attends its query slice to the full key set, and the output keeps the query slice. The
all-gather's transpose is a reduce-scatter, so the backward pass is exact too. Heads split over ``tensor`` need no
communication at all. The per-device core is any ``AttentionFn``: the Pallas splash kernel on TPU (a single-device
kernel, which is why it must run inside ``shard_map``), XLA elsewhere.

Cross-attention keys/values come from the 512 text tokens, which are never split over ``context``.

Packed rows (``segments``): the query ids are split like the queries; the key ids are whole on every device (the
self-attention keys are gathered, the text is never split), so each device builds its own block tables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from wanloom_trainer.model.segment_attention import Segments
from wanloom_trainer.parallel.mesh_jax import BATCH_AXES, ShardingConfig

AttentionFn = Callable[..., jax.Array]


def context_parallel_attention(core: AttentionFn, shardings: ShardingConfig, *, cross: bool) -> AttentionFn:
    """Wrap ``core`` for the mesh: self-attention (``cross=False``) gathers K/V over ``context``."""
    q_spec = shardings.q_bsnh
    kv_spec = shardings.kv_blnh if cross else shardings.q_bsnh
    gather = not cross and shardings.axis_size("context") > 1

    def local(q_bsnh: jax.Array, k_bknh: jax.Array, v_bknh: jax.Array, *ids: jax.Array, max_tokens: int = 0):
        if gather:
            k_bknh = jax.lax.all_gather(k_bknh, "context", axis=1, tiled=True)
            v_bknh = jax.lax.all_gather(v_bknh, "context", axis=1, tiled=True)
        if not ids:
            return core(q_bsnh, k_bknh, v_bknh)
        return core(q_bsnh, k_bknh, v_bknh, Segments(*ids, max_tokens=max_tokens))

    specs = (q_spec, kv_spec, kv_spec)
    sharded = jax.shard_map(local, mesh=shardings.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
    ids_specs = (PartitionSpec(BATCH_AXES, "context"), PartitionSpec(BATCH_AXES, None))

    def attention(
        q_bsnh: jax.Array, k_bknh: jax.Array, v_bknh: jax.Array, segments: Segments | None = None
    ) -> jax.Array:
        _check_divisible(q_bsnh.shape, shardings)
        if segments is None:
            return sharded(q_bsnh, k_bknh, v_bknh)
        packed = jax.shard_map(
            functools.partial(local, max_tokens=segments.max_tokens),
            mesh=shardings.mesh,
            in_specs=(*specs, *ids_specs),
            out_specs=q_spec,
            check_vma=False,
        )
        return packed(q_bsnh, k_bknh, v_bknh, segments.q, segments.kv)

    return attention


def _check_divisible(shape: tuple[int, ...], shardings: ShardingConfig) -> None:
    batch = shardings.axis_size("data") * shardings.axis_size("fsdp")
    context, tensor = shardings.axis_size("context"), shardings.axis_size("tensor")
    b, s, n, _ = shape
    if b % batch or s % context or n % tensor:
        raise ValueError(
            f"attention input [b={b}, s={s}, n={n}] does not split over data x fsdp={batch}, context={context}, "
            f"tensor={tensor}: micro-batches must hold a multiple of the data-parallel ranks, token counts a "
            "multiple of spec.parallelism.context and heads a multiple of spec.parallelism.tensor"
        )
