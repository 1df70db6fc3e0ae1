"""Accelerator shapes: TPU v7x slice topologies and GPU node types (GKE conventions, docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

# Single-host and small multi-host shapes GKE offers; larger ones follow the cube rule in `tpu7x_slice`.
_SMALL_TPU7X_TOPOLOGIES = ("1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4")
_MAX_CUBES = 144


@dataclass(frozen=True)
class Machine:
    """A node's machine type as GKE provisions it for the accelerator (Compute Engine's published shapes)."""

    name: str
    vcpus: int
    memory_gb: int
    accelerators: int  # TPU chips or GPUs per VM


@dataclass(frozen=True)
class AcceleratorType:
    """One accelerator a TrainingJob can name: how GKE labels and provisions its nodes, and what one chip does."""

    kind: str  # "tpu" or "gpu": the spec's resources field that names it
    gke_label: str  # value of cloud.google.com/gke-tpu-accelerator or cloud.google.com/gke-accelerator
    machine: Machine
    peak_bf16_flops: float  # dense (no 2:4 sparsity) bf16 matmul peak of one chip, from the vendor's data sheet
    peak_note: str
    devices_per_chip: int = 1  # framework devices one chip shows (JAX: one per TPU7x TensorCore)
    hbm_bytes: int | None = None  # per chip, where a check uses it (`wanloom compile`)


# The one table of accelerator facts: the API's types, the operator's node selectors and pod sizes, the trainer's
# MFU peaks and the compile check's HBM all read it. TPU7x: 4-chip VM, 224 vCPU, 960 GB, 192 GiB HBM and 4,614
# TFLOP/s FP8 per chip, half that in bf16 (cloud.google.com/tpu/docs/tpu7x); GPU: the 8-GPU A3/A4 shapes, and the
# memory the driver reports per GPU (nvidia-smi's total: 81,559 MiB H100 80GB, 143,771 MiB H200, 183,359 MiB B200).
ACCELERATOR_TYPES = {
    "tpu7x": AcceleratorType(
        "tpu", "tpu7x", Machine("tpu7x-standard-4t", 224, 960, 4), 2307e12,
        "TPU v7x (Ironwood), per chip (2 TensorCores)", devices_per_chip=2, hbm_bytes=192 * 2**30,
    ),
    "h100": AcceleratorType(
        "gpu", "nvidia-h100-80gb", Machine("a3-highgpu-8g", 208, 1872, 8), 989e12, "NVIDIA H100 SXM, dense bf16",
        hbm_bytes=81_559 * 2**20,
    ),
    "h200": AcceleratorType(
        "gpu", "nvidia-h200-141gb", Machine("a3-ultragpu-8g", 224, 2952, 8), 989e12,
        "NVIDIA H200 SXM, dense bf16 (same SM array as H100)", hbm_bytes=143_771 * 2**20,
    ),
    "b200": AcceleratorType(
        "gpu", "nvidia-b200", Machine("a4-highgpu-8g", 224, 3968, 8), 2250e12, "NVIDIA B200 (HGX), dense bf16",
        hbm_bytes=183_359 * 2**20,
    ),
}  # fmt: skip
GPU_TYPES = tuple(name for name, a in ACCELERATOR_TYPES.items() if a.kind == "gpu")
GPUS_PER_NODE = {name: ACCELERATOR_TYPES[name].machine.accelerators for name in GPU_TYPES}
_TPU7X = ACCELERATOR_TYPES["tpu7x"]
CHIPS_PER_TPU7X_HOST = _TPU7X.machine.accelerators
TENSORCORES_PER_TPU7X_CHIP = _TPU7X.devices_per_chip  # each TensorCore is one JAX device
# Share of a machine's vCPUs and memory a trainer pod requests for its share of the accelerators: what GKE keeps
# for the kubelet, system daemons and the accelerator's device plugin stays free (allocatable is ~97% of memory
# on these sizes; daemon sets take a few cores).
REQUEST_FRACTION = 0.75


@dataclass(frozen=True)
class TPUSlice:
    topology: str
    chips: int

    @property
    def hosts(self) -> int:
        """Pods per slice: one per VM of four chips (single-host shapes have one)."""
        return max(1, self.chips // CHIPS_PER_TPU7X_HOST)

    @property
    def chips_per_host(self) -> int:
        return min(self.chips, CHIPS_PER_TPU7X_HOST)

    @property
    def devices(self) -> int:
        return self.chips * TENSORCORES_PER_TPU7X_CHIP

    @property
    def machine_type(self) -> str:
        return "tpu7x-standard-1t" if self.chips == 1 else "tpu7x-standard-4t"


def tpu7x_slice(topology: str) -> TPUSlice:
    """Parse and check a tpu7x topology ``AxBxC``.

    Raises:
        ValueError: naming the valid shapes when ``topology`` is not one GKE offers.
    """
    try:
        dims = tuple(int(d) for d in topology.split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"{topology!r} is not of the form AxBxC; {valid_tpu7x_topologies()}")
    chips = dims[0] * dims[1] * dims[2]
    if topology in _SMALL_TPU7X_TOPOLOGIES:
        return TPUSlice(topology, chips)
    a, b, c = dims
    cubes = (a // 4) * (b // 4) * (c // 4)
    if all(d % 4 == 0 for d in dims) and a <= b <= c and cubes <= _MAX_CUBES:
        return TPUSlice(topology, chips)
    raise ValueError(f"{topology!r} is not a tpu7x topology; {valid_tpu7x_topologies()}")


# The longest topology string a valid shape can have ("4x4x576": a dimension is at most 4 x 144); the CRD bounds
# the field so that its CEL rules parse at most three 3-digit numbers.
TPU7X_TOPOLOGY_MAX_LENGTH = 11


def tpu7x_chips_cel(topology: str) -> str:
    """CEL: the chip count of the ``AxBxC`` string at ``topology`` (a CEL expression)."""
    a, b, c = (f"int({topology}.split('x')[{i}])" for i in range(3))
    return f"{a} * {b} * {c}"


def tpu7x_topology_cel(topology: str) -> str:
    """CEL: whether the string at ``topology`` is a shape :func:`tpu7x_slice` accepts (the same table and rule)."""
    a, b, c = (f"int({topology}.split('x')[{i}])" for i in range(3))
    small = "[" + ", ".join(f"'{t}'" for t in _SMALL_TPU7X_TOPOLOGIES) + "]"
    cubes = f"({a} / 4) * ({b} / 4) * ({c} / 4)"
    return (
        f"({topology} in {small} || ({a} % 4 == 0 && {b} % 4 == 0 && {c} % 4 == 0 && {a} <= {b} && {b} <= {c} "
        f"&& {cubes} <= {_MAX_CUBES}))"
    )


def valid_tpu7x_topologies() -> str:
    return (
        f"valid: {', '.join(_SMALL_TPU7X_TOPOLOGIES)}, or AxBxC with A, B, C multiples of 4, A <= B <= C and at most "
        f"{_MAX_CUBES} 4x4x4 cubes (e.g. 4x4x4, 4x4x8, 4x8x8, 8x8x8, 8x8x16, 8x16x16, 16x16x16)"
    )
