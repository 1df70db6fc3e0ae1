"""``wanloom compile`` for GPU jobs: the per-device memory peak of the trainer's own torch step, without a GPU.

What is traced is what ``TorchBackend`` builds for one rank: the variant's diffusers ``WanTransformer3DModel``
(fused AdaLN when the job asks for it), ``parallelize_wan`` with the job's mesh, remat policy and precision (FSDP2
over fsdp × context ranks, Ulysses context parallelism), AdamW's moments made as ``make_adamw`` makes them. All of it
lives on fake tensors (``FakeTensorMode``) over a fake process group of the job's world size: nothing is allocated
and no GPU is needed. PyTorch's ``FSDPMemTracker`` follows one forward and backward of the largest micro-batch a
rank gets of each bucket (``memoryBudgetTokens // tokens`` rows, the trainer's flow-matching loss), with the expert's
gradients already accumulated, as in a step's later slots.

Peak per device of a micro-batch = the traced peak + the other expert's resident state (its parameters, gradients
and moments: both experts stay resident and both may hold gradients within a step). A LoRA job traces an adapted
expert: its base frozen, gradients and moments for the adapters alone. The AdamW update is sized apart:
both experts' state plus one fp32 copy of the updated expert's shards (torch's foreach AdamW computes sqrt(v) for
all of them at once; the tracker over-counts foreach ops on DTensors, so this one term is added by hand). A job fits
when the peak plus ``RUNTIME_RESERVE_BYTES`` (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation)
stays within the GPU's memory (``wanloom_api.topology``).

The trace runs on the CPU device type, where PyTorch's SDPA takes its flash kernel (output and log-sum-exp saved,
no S × S matrix), as the GPU's flash and memory-efficient kernels do; ``kernels.attention: flash`` is traced as SDPA.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from wanloom_api.topology import ACCELERATOR_TYPES
from wanloom_trainer.backends.step_shapes import checked_config, compile_shapes
from wanloom_trainer.config.train_config import TrainConfig

RUNTIME_RESERVE_BYTES = 3 * 2**30
# FSDPMemTracker's categories, grouped as the report shows them.
_STATE = {"Sharded Param": "parameters", "Buffer": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer"}


@dataclass(frozen=True)
class MicroBatchMemory:
    """The traced forward + backward of one bucket's micro-batch on one rank."""

    latent_shape: tuple[int, int, int]
    rows_per_rank: int
    tokens_per_row: int  # the sample's tokens; each context rank holds tokens_per_row / context of them
    trace_seconds: float
    activation_bytes: int  # at the peak: activations, temporaries and inputs
    collective_bytes: int  # at the peak: unsharded parameters and gradients, all-gather / reduce-scatter buffers
    peak_bytes: int  # per device, both experts' resident state included


@dataclass(frozen=True)
class GpuSizingReport:
    job: str
    accelerator: str
    gpus: int
    mesh: dict[str, int]
    remat: str
    layers: int
    capacity_bytes_per_device: int
    parameter_bytes: int  # both experts, per device
    gradient_bytes: int
    optimizer_bytes: int
    update_peak_bytes: int
    micro_batches: list[MicroBatchMemory]

    @property
    def peak_bytes_per_device(self) -> int:
        return max([self.update_peak_bytes, *(m.peak_bytes for m in self.micro_batches)])

    def fits_at(self, peak: int) -> bool:
        return peak + RUNTIME_RESERVE_BYTES <= self.capacity_bytes_per_device

    @property
    def fits(self) -> bool:
        return self.fits_at(self.peak_bytes_per_device)

    def as_dict(self) -> dict[str, Any]:
        activations = max((m.activation_bytes for m in self.micro_batches), default=0)
        return {
            **{k: v for k, v in asdict(self).items() if k != "micro_batches"},
            "compiled": True,
            "fits": self.fits,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "runtime_reserve_bytes": RUNTIME_RESERVE_BYTES,
            "breakdown": {
                "parameters": self.parameter_bytes,
                "gradients": self.gradient_bytes,
                "optimizer": self.optimizer_bytes,
                "activations": activations,
            },
            "micro_batches": [{**asdict(m), "fits": self.fits_at(m.peak_bytes)} for m in self.micro_batches],
        }

    def text(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        mesh = " × ".join(f"{k} {v}" for k, v in self.mesh.items())
        lines = [
            f"TrainingJob {self.job}: {self.gpus} × {self.accelerator}, mesh {mesh}, remat {self.remat}, "
            f"{self.layers} layers (traced on fake tensors, PyTorch FSDPMemTracker)",
            f"resident per GPU, both experts: parameters {gib(self.parameter_bytes)}, gradients "
            f"{gib(self.gradient_bytes)}, AdamW moments {gib(self.optimizer_bytes)}; capacity "
            f"{gib(self.capacity_bytes_per_device)} less a {gib(RUNTIME_RESERVE_BYTES)} runtime reserve",
            "| micro-batch latent T'×H'×W' | rows/rank × tokens | trace s | activations | collective buffers "
            "| peak/GPU | fits |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in self.micro_batches:
            lines.append(
                f"| {'×'.join(map(str, m.latent_shape))} | {m.rows_per_rank} × {m.tokens_per_row:,} | "
                f"{m.trace_seconds:.1f} | {gib(m.activation_bytes)} | {gib(m.collective_bytes)} | "
                f"{gib(m.peak_bytes)} | {'yes' if self.fits_at(m.peak_bytes) else 'NO'} |"
            )
        fits = "yes" if self.fits_at(self.update_peak_bytes) else "NO"
        lines.append(f"| AdamW update | | | | | {gib(self.update_peak_bytes)} | {fits} |")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"peak {gib(self.peak_bytes_per_device)} per GPU: {verdict}")
        return "\n".join(lines)


def _by_category(snapshot: dict[Any, int]) -> dict[str, int]:
    out = {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0, "collectives": 0, "total": 0}
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total":
            out["total"] = value
        elif name in _STATE:
            out[_STATE[name]] += value
        elif name in ("Activation", "Temp", "Inputs"):
            out["activations"] += value
        else:
            out["collectives"] += value
    return out


def _fake_batch(config: TrainConfig, latent: tuple[int, int, int], rows: int) -> dict[str, Any]:
    """One rank's micro-batch as the step feeds the loss (``step_torch.rows_to_tensors``), on fake tensors."""
    import torch

    wan = config.model.wan
    batch = {
        "latents": torch.randn(rows, wan.out_channels, *latent),
        "noise": torch.randn(rows, wan.out_channels, *latent),
        "text": torch.randn(rows, wan.text_len, wan.text_dim),
        "timesteps": torch.full((rows,), 500.0),
        "weights": torch.ones(rows),
    }
    if wan.condition_channels:
        batch["condition"] = torch.randn(rows, wan.condition_channels, *latent)
    if wan.per_token_timesteps:  # the image-to-video rows: per-token timesteps, frame 0 clean
        batch["clean_first_frame"] = torch.ones(rows)
    return batch


def size_job(
    job: Any,
    *,
    pixels: np.ndarray | None = None,
    layers: int | None = None,
    remat: str | None = None,
    capacity_bytes: int | None = None,
) -> GpuSizingReport:
    """Trace the job's torch step on fake tensors and report per-GPU memory (see the module docstring).

    Args:
        job: a validated TrainingJob with ``spec.resources.gpu``.
        pixels: pixel shapes (F, H, W) [k, 3] to size (default: the job's buckets, else the variant's reference
            clip).
        layers: a model of this depth instead of the variant's (quick checks).
        remat: a ``spec.parallelism.remat`` value overriding the job's.
        capacity_bytes: memory per GPU (default: the accelerator table's).

    Raises:
        ValueError: naming the field when the job cannot be sized (not a GPU job, an unknown GPU type without
            ``capacity_bytes``).

    Runs in a process of its own: it initialises a fake process group (``wanloom compile`` is one).
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from wanloom_trainer.backends.torch.step import make_adamw

    gpu = job.spec.resources.gpu
    if gpu is None:
        raise ValueError("wanloom compile: sizing a GPU job needs spec.resources.gpu")
    accelerator = ACCELERATOR_TYPES.get(gpu.type)
    capacity = capacity_bytes or (accelerator.hbm_bytes if accelerator else None)
    if capacity is None:
        raise ValueError(f"spec.resources.gpu.type {gpu.type!r} has no known memory: pass --hbm-gib")
    config = checked_config(job, layers=layers, remat=remat)
    world = config.parallel.num_devices
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = _meshes(config, world)
    shapes = compile_shapes(config, pixels)
    trained = config.adapted_experts.index(True) if config.lora is not None else 0  # an expert that trains
    model = _expert(config, mesh, trained)
    with FakeTensorMode(allow_non_fake_inputs=True):  # the meta-device parameters are its inputs
        model.to_empty(device="cpu")  # as TorchBackend materialises its meta-device model, here on fake tensors
        optimizer = make_adamw(model.parameters(), config.optimizer)
        for p in model.parameters():  # a later slot of the step: the expert's gradients are already there
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        micro_batches, resident = [], None
        for latent in shapes:
            latent = (int(latent[0]), int(latent[1]), int(latent[2]))
            micro, static = _trace(config, model, optimizer, latent, FSDPMemTracker)
            resident = static
            micro_batches.append(micro)
    assert resident is not None
    # The other expert: alike, or with LoRA on one expert its frozen base alone (adapters are a rounding error).
    trains = [config.lora is None or a for a in config.adapted_experts]
    state = resident["parameters"] + resident["gradients"] + resident["optimizer"]
    other = sum(state if t else resident["parameters"] for e, t in enumerate(trains) if e != trained)
    micro_batches = [dataclasses.replace(m, peak_bytes=m.peak_bytes + other) for m in micro_batches]
    # The update: both experts resident, plus sqrt(v) over the updated expert's shards (fp32, like its moments).
    update = state + other + resident["optimizer"] // 2
    experts = config.model.num_experts
    return GpuSizingReport(
        job=job.metadata.name,
        accelerator=gpu.type,
        gpus=world,
        mesh={"data": config.parallel.data, "fsdp": config.parallel.fsdp, "context": config.parallel.context},
        remat=config.model.remat,
        layers=config.model.wan.num_layers,
        capacity_bytes_per_device=capacity,
        parameter_bytes=experts * resident["parameters"],
        gradient_bytes=sum(trains) * resident["gradients"],
        optimizer_bytes=sum(trains) * resident["optimizer"],
        update_peak_bytes=update,
        micro_batches=micro_batches,
    )


def _meshes(config: TrainConfig, world: int) -> Any:
    """The job's meshes over the fake process group (built outside fake mode: they read real rank tensors)."""
    from wanloom_trainer.parallel.mesh_torch import build_torch_mesh

    return build_torch_mesh(config.parallel, world, "cpu")


def _expert(config: TrainConfig, mesh: Any, expert: int) -> Any:
    """Expert ``expert`` as ``TorchBackend._build_expert`` makes it: on the meta device, patched (LoRA: frozen, with
    adapters) and parallelised (real device meshes: diffusers and FSDP read them), not yet materialised."""
    import torch
    from diffusers import WanTransformer3DModel
    from torch.distributed.fsdp import FSDPModule

    from wanloom_trainer.backends.torch.backend import DTYPES
    from wanloom_trainer.model.lora_torch import add_lora
    from wanloom_trainer.model.wan_torch import apply_adaln_impl
    from wanloom_trainer.parallel.mesh_torch import MixedPrecision, apply_fsdp, parallelize_wan

    precision = MixedPrecision(DTYPES[config.model.param_dtype], DTYPES[config.model.compute_dtype])
    with torch.device("meta"):
        model = WanTransformer3DModel(**config.model.wan.diffusers_config())
    model = apply_adaln_impl(model, config.model.adaln)
    if precision.param_dtype != torch.float32:
        model.to(precision.param_dtype)
    if config.lora is not None and config.adapted_experts[expert]:
        add_lora(model, config.lora, seed=0)
    parallelize_wan(model, mesh=mesh, remat=config.model.remat, mixed_precision=precision)
    if not isinstance(model, FSDPModule):  # one GPU, one dtype: the trainer leaves it plain; the tracker needs FSDP
        apply_fsdp(model, mesh.fsdp, precision)
    return model


def _trace(
    config: TrainConfig, model: Any, optimizer: Any, latent: tuple[int, int, int], tracker_type: type
) -> tuple[MicroBatchMemory, dict[str, int]]:
    """Forward + backward of one micro-batch under the tracker: (its memory, the expert's resident state)."""
    import torch

    from wanloom_trainer.backends.torch.backend import DTYPES
    from wanloom_trainer.backends.torch.step import flow_matching_loss

    wan = config.model.wan
    tokens = wan.tokens(*latent)
    rows = max(1, config.adaptive_load.memory_budget_tokens // tokens)
    batch = _fake_batch(config, latent, rows)
    tracker = tracker_type(model, optimizer)
    tracker.track_inputs(tuple(batch.values()))
    start = time.perf_counter()
    with tracker:
        static = _by_category(tracker.get_tracker_snapshot()[torch.device("cpu")])
        loss, _ = flow_matching_loss(model, **batch, compute_dtype=DTYPES[config.model.compute_dtype])
        loss.backward()
    peak = _by_category(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
    seconds = time.perf_counter() - start
    micro = MicroBatchMemory(
        latent_shape=latent,
        rows_per_rank=rows,
        tokens_per_row=tokens,
        trace_seconds=round(seconds, 1),
        activation_bytes=peak["activations"],
        collective_bytes=peak["collectives"],
        peak_bytes=peak["total"],
    )
    return micro, static
