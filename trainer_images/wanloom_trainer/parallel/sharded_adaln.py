"""The fused AdaLN kernel on a device mesh: a Pallas (Mosaic) kernel cannot be partitioned by XLA, so it runs per
shard inside ``shard_map``, like the attention core (``context_attention.py``).

Each device normalises its own tokens: the residual stream ``x [b, s, d]`` is split over the batch axes and its
sequence over ``context`` *and* ``tensor`` (sequence parallelism in the norm, Megatron-SP style), so no device
repeats another's work and every input is either split or, for per-sample modulation ``[b, 1, d]``, replicated
along the sequence. The shard_map transpose then sums d_scale/d_shift of a replicated modulation over the devices
that share it, which is the column sum over the whole sequence. XLA re-gathers y over ``tensor`` for the
column-parallel projections that follow, as it would for any sequence-parallel activation.

Per-token modulation (TI2V) is split exactly like x. Packed rows: the segment ids are split like x's rows and the
per-segment modulation ``[b, S, d]`` is replicated along the sequence like a per-sample one, so the transpose sums
each shard's per-segment partial column sums.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from wanloom_trainer.parallel.mesh_jax import BATCH_AXES, ShardingConfig, runs_mosaic

AdaLNFn = Callable[..., jax.Array]  # (x, scale, shift, segment_ids=None) -> y
SEQUENCE_AXES = ("context", "tensor")


def sharded_adaln(shardings: ShardingConfig, *, eps: float) -> AdaLNFn:
    """``adaln(x [b, s, d], scale, shift, segment_ids=None) -> y`` running the fused kernel per shard of
    ``shardings.mesh``."""
    from wanloom_trainer.kernels.adaln_pallas import adaln_pallas

    rows = PartitionSpec(BATCH_AXES, SEQUENCE_AXES, None)
    per_sample = PartitionSpec(BATCH_AXES, None, None)
    batch = shardings.axis_size("data") * shardings.axis_size("fsdp")
    sequence = shardings.axis_size("context") * shardings.axis_size("tensor")
    # The mesh decides, not jax.default_backend(): a CPU host compiling ahead of time for a TPU topology must
    # lower Mosaic, while CPU meshes run the interpreter.
    platform = shardings.mesh.devices.flat[0].platform
    if platform == "gpu":
        raise ValueError(
            "kernels.adaln: fused: the Pallas kernel is a TPU (Mosaic) kernel and this mesh is on gpu; use "
            "spec.kernels.adaln: reference with backend jax, or the PyTorch backend (Triton) on NVIDIA GPUs"
        )
    interpret = not runs_mosaic(shardings.mesh)
    local = lambda x, scale, shift: adaln_pallas(x, scale, shift, eps, interpret)
    per_spec = {
        mod_rows: jax.shard_map(
            local,
            mesh=shardings.mesh,
            in_specs=(rows, spec, spec),
            out_specs=rows,
            check_vma=False,
        )
        for mod_rows, spec in ((False, per_sample), (True, rows))
    }
    per_segment = jax.shard_map(
        lambda x, scale, shift, ids: adaln_pallas(x, scale, shift, eps, interpret, segment_ids=ids),
        mesh=shardings.mesh,
        in_specs=(rows, per_sample, per_sample, PartitionSpec(BATCH_AXES, SEQUENCE_AXES)),
        out_specs=rows,
        check_vma=False,
    )

    def adaln(x: jax.Array, scale: jax.Array, shift: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        b, s, _ = x.shape
        if b % batch or s % sequence:
            raise ValueError(
                f"fused AdaLN input [b={b}, s={s}] does not split over data x fsdp={batch} and context x "
                f"tensor={sequence}: micro-batches must hold a multiple of the data-parallel ranks and token counts "
                "a multiple of spec.parallelism.context x spec.parallelism.tensor"
            )
        if segment_ids is not None:
            return per_segment(x, scale, shift, segment_ids)
        if scale.ndim == 2:
            scale, shift = scale[:, None], shift[:, None]
        per_token = scale.shape[1] == s and s > 1
        return per_spec[per_token](x, scale, shift)

    return adaln
