"""``wanloom compile``: the TPU job's real training step compiled ahead of time on any host (libtpu, no TPU).

What is compiled is what the trainer runs: the job's mesh (data × fsdp × context × tensor over the tpu7x topology's
devices, a hybrid mesh across slices), its remat policy, kernels and attention, and for every shape bucket the
micro-batch AdaptiveLoad gives one data-parallel rank (``memoryBudgetTokens // tokens`` rows, padded to a power of two
as the backend pads them); with the balanced scheduler the trainer packs (``adaptiveload.assignment.packing``), so the
packer's two programs are compiled too (``packing.row_shapes``): long rows of ``memoryBudgetTokens`` tokens and short
rows of a quarter of that per rank, with as many segment slots as the smallest bucket can fill up to the AdaLN kernel's
VMEM cap (``kernels.adaln_shapes.max_packed_segments``). Both experts share one architecture and so one program: the
gradient accumulation (forward + backward of a slot) and the AdamW update are compiled once each and their memory is
added to what stays resident, both experts' parameters and optimizer states. No parameter is allocated.

Peak per device = resident state of both experts (a LoRA job's: adapters, their optimizer state and the frozen base)
+ the program's arguments beyond the expert's own parameters (and, for the update, its optimizer state) +
temporaries + outputs not aliased to inputs, from XLA's
``memory_analysis()``; the capacity is the HBM of one JAX device (``HBM_BYTES_PER_DEVICE``). ``cost_analysis()`` is
not used: it omits Pallas kernels and counts a scan body once (MFU keeps the analytic FLOPs of ``flops.py``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from wanloom_api.topology import ACCELERATOR_TYPES
from wanloom_trainer.backends.step_shapes import checked_config, compile_shapes
from wanloom_trainer.config.train_config import TrainConfig

# TPU v7x (Ironwood): two TensorCores per chip, each its own JAX device (the topology descriptions list 2 devices
# per chip), so one device addresses half the chip's HBM: 96 GiB. Seed 000 reports 94.7 GB usable.
_TPU7X = ACCELERATOR_TYPES["tpu7x"]
HBM_BYTES_PER_DEVICE = {"tpu7x": _TPU7X.hbm_bytes // _TPU7X.devices_per_chip}
# Variables of spec.resources.env that change what libtpu compiles (read once, when libtpu loads).
COMPILER_ENV = ("LIBTPU_INIT_ARGS",)


@dataclass(frozen=True)
class ProgramMemory:
    """One compiled program at one micro-batch shape."""

    program: str  # "accumulate" (forward + backward of one slot), "accumulate-packed[-short]" or "update" (AdamW)
    latent_shape: tuple[int, int, int]
    rows_per_rank: int
    tokens_per_row: int
    segments_per_row: int  # packed: segment slots per row (samples + padding); 1 otherwise
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # per device, with the resident state


@dataclass(frozen=True)
class CompileReport:
    job: str
    topology: str
    slices: int
    devices: int
    mesh: dict[str, int]
    remat: str
    layers: int
    resident_bytes: int
    capacity_bytes_per_device: int
    programs: list[ProgramMemory]

    @property
    def peak_bytes_per_device(self) -> int:
        return max(p.peak_bytes for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.peak_bytes_per_device <= self.capacity_bytes_per_device

    def as_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "programs"},
            "compiled": True,
            "fits": self.fits,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "programs": [asdict(p) for p in self.programs],
        }

    def text(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        mesh = " × ".join(f"{k} {v}" for k, v in self.mesh.items())
        lines = [
            f"TrainingJob {self.job}: {self.slices} × tpu7x:{self.topology} = {self.devices} devices, mesh {mesh}, "
            f"remat {self.remat}, {self.layers} layers",
            f"resident per device (both experts: parameters + optimizer state): {gib(self.resident_bytes)}; "
            f"capacity {gib(self.capacity_bytes_per_device)} per device (tpu7x: {gib(_TPU7X.hbm_bytes)} per chip, "
            f"{_TPU7X.devices_per_chip} devices)",
            "| program | latent T'×H'×W' | rows/rank × tokens | segments | compile s | arguments | temporaries "
            "| peak/device | fits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in self.programs:
            fits = "yes" if p.peak_bytes <= self.capacity_bytes_per_device else "NO"
            lines.append(
                f"| {p.program} | {'×'.join(map(str, p.latent_shape))} | {p.rows_per_rank} × {p.tokens_per_row:,} | "
                f"{p.segments_per_row} | {p.compile_seconds:.1f} | {gib(p.argument_bytes)} | {gib(p.temp_bytes)} | "
                f"{gib(p.peak_bytes)} | {fits} |"
            )
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"peak {gib(self.peak_bytes_per_device)} per device: {verdict}")
        return "\n".join(lines)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (the largest shard of each leaf)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def _tpu_devices(job: Any) -> tuple[str, int, list[Any]]:
    from jax.experimental import topologies

    tpu = job.spec.resources.tpu
    if tpu is None:
        raise ValueError(
            "wanloom compile: set spec.resources.tpu or spec.resources.gpu; a CPU job runs here as it is (wanloom run)"
        )
    name = f"tpu7x:{tpu.topology}"
    devices = topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=tpu.slices).devices
    return tpu.topology, tpu.slices, list(devices)


def _batch(backend: Any, config: TrainConfig, latent: tuple[int, ...], rows: int) -> dict[str, Any]:
    """Abstract global arrays of one slot, sharded as the backend places them."""
    import jax
    import jax.numpy as jnp

    wan = config.model.wan
    total = rows * config.parallel.batch_ranks
    spec = lambda *shape: jax.ShapeDtypeStruct((total, *shape), jnp.float32, sharding=backend.shardings.batch_b)
    batch = {
        "latents": spec(wan.out_channels, *latent),
        "noise": spec(wan.out_channels, *latent),
        "text": spec(wan.text_len, wan.text_dim),
        "timesteps": spec(),
        "weights": spec(),
    }
    if wan.in_channels > wan.out_channels:  # image-to-video: mask + encoded first frame appended to x_t
        batch["condition"] = spec(wan.in_channels - wan.out_channels, *latent)
    if wan.per_token_timesteps:  # unified TI2V: the step runs with per-token timesteps
        batch["clean_first_frame"] = spec()
    return batch


def _packed_batch(backend: Any, config: TrainConfig, row_tokens: int, groups: int) -> dict[str, Any]:
    """Abstract global arrays of one packed slot (``backends.packing.PackedRows``, one row per rank)."""
    import jax
    import jax.numpy as jnp

    wan = config.model.wan
    ranks, q = config.parallel.batch_ranks, math.prod(wan.patch_size)
    spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(
        (ranks, *shape), dtype, sharding=backend.shardings.batch_b
    )
    batch = {
        "latents": spec(row_tokens, q, wan.out_channels),
        "noise": spec(row_tokens, q, wan.out_channels),
        "positions": spec(row_tokens, 3, dtype=jnp.int32),
        "segment_ids": spec(row_tokens, dtype=jnp.int32),
        "text": spec(groups, wan.text_len, wan.text_dim),
        "timesteps": spec(groups),
        "weights": spec(groups),
    }
    if wan.in_channels > wan.out_channels:
        batch["condition"] = spec(row_tokens, q, wan.in_channels - wan.out_channels)
    if wan.per_token_timesteps:
        batch["clean_first_frame"] = spec(row_tokens)
    return batch


def packed_programs(config: TrainConfig, tokens: np.ndarray) -> list[tuple[str, int, int, int]]:
    """(program, row tokens, segment slots, longest segment) of the packer's programs over buckets of ``tokens``."""
    from wanloom_trainer.adaptiveload.assignment.packing import row_shapes
    from wanloom_trainer.kernels.adaln_shapes import max_packed_segments

    multiple = config.parallel.context * config.parallel.tensor
    segments = max_packed_segments(config.model.wan.dim)
    step_tokens = float(np.mean(tokens)) * config.global_batch / config.parallel.batch_ranks  # as the planner sizes it
    shapes = row_shapes(tokens, config.adaptive_load.memory_budget_tokens, multiple, segments, step_tokens)
    long, short = shapes.programs()
    return [("accumulate-packed", *long), ("accumulate-packed-short", *short)]


def _memory(compiled: Any) -> tuple[int, int, int, int]:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes


def compile_job(
    job: Any,
    *,
    pixels: np.ndarray | None = None,
    layers: int | None = None,
    remat: str | None = None,
    capacity_bytes: int | None = None,
) -> CompileReport:
    """Compile the job's step for its TPU topology and report per-device memory (see the module docstring).

    Args:
        job: a validated TrainingJob with ``spec.resources.tpu``.
        pixels: pixel shapes (F, H, W) [k, 3] to compile at (default: the job's buckets, else the variant's
            reference clip).
        layers: compile a model of this depth instead of the variant's (quick checks).
        remat: a ``spec.parallelism.remat`` value overriding the job's.
        capacity_bytes: HBM per device (default ``HBM_BYTES_PER_DEVICE``).

    Raises:
        ValueError: naming the field when the job cannot be compiled for a TPU.
    """
    import jax
    import jax.numpy as jnp

    from wanloom_trainer.adaptiveload.sizing.tokens import tokens_for_latents
    from wanloom_trainer.backends.jax.backend import JaxBackend, pad_rows

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a second JAX process here must not hold libtpu
    use_compiler_env(job)
    topology, slices, devices = _tpu_devices(job)
    config = checked_config(job, layers=layers, remat=remat)
    backend = JaxBackend(config.backend_config, devices=devices)
    state = backend.abstract_state()
    (params, *_), (opt, *_) = backend.flat_state(state["params"], state["opt"])
    frozen = backend.abstract_frozen()  # LoRA: the base, resident beside the adapters; else []
    resident = sum(device_bytes(p) + device_bytes(o) + device_bytes(frozen)
                   for p, o in zip(state["params"], state["opt"], strict=True))  # fmt: skip
    param_bytes, opt_bytes = device_bytes(params) + device_bytes(frozen), device_bytes(opt)
    shapes = compile_shapes(config, pixels)
    programs = []
    for latent, tokens in zip(shapes, tokens_for_latents(config.model.wan, shapes), strict=True):
        rows = pad_rows(max(1, config.adaptive_load.memory_budget_tokens // int(tokens)))
        start = time.perf_counter()
        compiled = backend.step_fns.accumulate.lower(
            params, frozen, params, _batch(backend, config, tuple(latent), rows)
        )
        compiled = compiled.compile()
        args, out, alias, temp = _memory(compiled)
        peak = resident - param_bytes + args + temp + out - alias
        seconds = time.perf_counter() - start
        shape = (int(latent[0]), int(latent[1]), int(latent[2]))
        programs.append(ProgramMemory("accumulate", shape, rows, int(tokens), 1, seconds, args, out, alias, temp, peak))
    if config.adaptive_load.enabled and config.adaptive_load.scheduler == "balanced":
        for name, row, groups, longest in packed_programs(config, tokens_for_latents(config.model.wan, shapes)):
            start = time.perf_counter()
            batch = _packed_batch(backend, config, row, groups)
            lowered = backend.step_fns.accumulate.lower(params, frozen, params, batch, longest)
            args, out, alias, temp = _memory(lowered.compile())
            peak = resident - param_bytes + args + temp + out - alias
            seconds = time.perf_counter() - start
            programs.append(ProgramMemory(name, (0, 0, 0), 1, row, groups, seconds, args, out, alias, temp, peak))
    start = time.perf_counter()
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=backend.shardings.replicated)
    compiled = backend.step_fns.update.lower(params, opt, params, lr).compile()
    args, out, alias, temp = _memory(compiled)
    peak = resident - (param_bytes - device_bytes(frozen)) - opt_bytes + args + temp + out - alias
    seconds = time.perf_counter() - start
    programs.append(ProgramMemory("update", (0, 0, 0), 0, 0, 0, seconds, args, out, alias, temp, peak))
    mesh = {name: int(size) for name, size in backend.mesh.shape.items()}
    capacity = capacity_bytes or HBM_BYTES_PER_DEVICE["tpu7x"]
    return CompileReport(
        job.metadata.name, topology, slices, len(devices), mesh, config.model.remat, config.model.wan.num_layers,
        resident, capacity, programs,
    )  # fmt: skip


def use_compiler_env(job: Any) -> None:
    """Compile with the compiler options the job's pods get (``LIBTPU_INIT_ARGS`` in ``spec.resources.env``), unless
    this process sets its own. Takes effect only before libtpu loads: ``wanloom compile`` runs in a fresh process."""
    for var in job.spec.resources.env:
        if var.name in COMPILER_ENV:
            os.environ.setdefault(var.name, var.value)
