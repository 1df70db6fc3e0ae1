"""The device mesh and the named sharding rules of the JAX trainer.

Mesh axes, outermost first: ``data`` (replicated data parallel), ``fsdp`` (data parallel with parameters and
optimizer state sharded), ``context`` (the video token sequence is split), ``tensor`` (attention heads and the FFN
hidden dimension are split, Megatron style). All four are ``AxisType.Auto``: jax 0.10 defaults to Explicit axes,
under which a matmul over a sharded contracting dimension must be annotated by hand; Auto lets XLA insert the
FSDP all-gathers and reduce-scatters.

Shardings, by dimension letters (b batch, c channels, s video tokens, l text tokens, n heads, h head dim):

    latents_bcthw, text_bld, per-sample vectors   batch over (data, fsdp)
    q_bsnh, self-attention k/v                    (data, fsdp), context, tensor
    cross-attention k/v_blnh                      (data, fsdp), -, tensor
    parameters                                    tensor on the Megatron dim of attention/FFN kernels, then fsdp on
                                                  the largest remaining dimension it divides; else replicated
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from wanloom_trainer.config.train_config import MESH_AXES, ParallelConfig

BATCH_AXES = ("data", "fsdp")
# Column-parallel kernels [in, out] split their output over ``tensor``; row-parallel kernels split their input.
_COLUMN_PARALLEL = ("to_q.kernel", "to_k.kernel", "to_v.kernel", "ffn.net.0.proj.kernel")
_COLUMN_PARALLEL_BIAS = ("to_q.bias", "to_k.bias", "to_v.bias", "ffn.net.0.proj.bias")
_ROW_PARALLEL = ("to_out.0.kernel", "ffn.net.2.kernel")


def build_mesh(parallel: ParallelConfig, *, num_slices: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` of shape (data, fsdp, context, tensor) over all (or the given) devices.

    With several TPU slices the slowest link (DCN) carries the outermost axis that the slice count divides
    (data, else fsdp); everything else stays inside a slice (ICI).

    Raises:
        ValueError: when the device count differs from the degrees' product.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != parallel.num_devices:
        raise ValueError(
            f"spec.parallelism resolves to data={parallel.data} x fsdp={parallel.fsdp} x context={parallel.context} "
            f"x tensor={parallel.tensor} = {parallel.num_devices} devices, but JAX sees {len(devices)}; "
            "check spec.resources"
        )
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    # Devices of a multi-slice topology carry their slice (also when compiled ahead of time in one process).
    num_slices = max(num_slices, len({getattr(d, "slice_index", 0) for d in devices}))
    if num_slices > 1:
        return Mesh(_hybrid_devices(parallel, num_slices, devices), MESH_AXES, axis_types=axis_types)
    return jax.make_mesh(parallel.shape, MESH_AXES, axis_types=axis_types, devices=devices)


def _hybrid_devices(parallel: ParallelConfig, num_slices: int, devices: list[jax.Device]) -> np.ndarray:
    from jax.experimental import mesh_utils

    outer = 0 if parallel.data % num_slices == 0 else 1
    if parallel.shape[outer] % num_slices:
        raise ValueError(f"{num_slices} slices must divide spec.parallelism.data or .fsdp, got {parallel.shape}")
    dcn = [1, 1, 1, 1]
    dcn[outer] = num_slices
    ici = list(parallel.shape)
    ici[outer] //= num_slices
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)


def runs_mosaic(mesh: Mesh) -> bool:
    """Whether Pallas TPU kernels on this mesh compile with Mosaic (a TPU mesh, also one compiled ahead of time on a
    CPU host) rather than run in the Pallas interpreter (CPU meshes)."""
    return mesh.devices.flat[0].platform == "tpu"


@dataclass(frozen=True)
class ShardingConfig:
    """Named shardings of the step's inputs and activations on one mesh (field names carry dimension letters)."""

    mesh: Mesh

    def _named(self, *spec: object) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    @property
    def batch_b(self) -> NamedSharding:
        """Any per-sample array: leading batch dimension over (data, fsdp), the rest replicated."""
        return self._named(BATCH_AXES)

    @property
    def replicated(self) -> NamedSharding:
        return self._named()

    @property
    def q_bsnh(self) -> PartitionSpec:
        return PartitionSpec(BATCH_AXES, "context", "tensor", None)

    @property
    def kv_blnh(self) -> PartitionSpec:
        """Cross-attention keys/values over the (short, unsharded) text sequence."""
        return PartitionSpec(BATCH_AXES, None, "tensor", None)

    def axis_size(self, name: str) -> int:
        return int(self.mesh.shape[name])

    def param(self, name: str, abstract: jax.ShapeDtypeStruct) -> NamedSharding:
        """Placement of one parameter (``model.params`` naming): tensor split first, then FSDP."""
        return self._named(
            *param_partition(name, tuple(abstract.shape), self.axis_size("fsdp"), self.axis_size("tensor"))
        )


def param_partition(name: str, shape: tuple[int, ...], fsdp: int, tensor: int) -> tuple[str | None, ...]:
    """PartitionSpec entries of a parameter of ``shape`` named ``name`` (e.g. ``blocks.0.attn1.to_q.kernel``)."""
    spec: list[str | None] = [None] * len(shape)
    tensor_dim = _tensor_dim(name, shape)
    if tensor > 1 and tensor_dim is not None and shape[tensor_dim] % tensor == 0:
        spec[tensor_dim] = "tensor"
    if fsdp > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
        if free:
            spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
    return tuple(spec)


def _tensor_dim(name: str, shape: tuple[int, ...]) -> int | None:
    if name.endswith(_COLUMN_PARALLEL) or name.endswith(_COLUMN_PARALLEL_BIAS):
        return len(shape) - 1
    if name.endswith(_ROW_PARALLEL):
        return 0
    return None
