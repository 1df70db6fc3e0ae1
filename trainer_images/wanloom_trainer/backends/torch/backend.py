"""The PyTorch backend (``backends.interface.Backend``): both diffusers experts resident, each FSDP2-sharded.

State: ``TorchState(experts, optimizers)``, one entry per expert (0 = high noise ``transformer/``, 1 = low noise
``transformer_2/``). Experts are built on the meta device, patched (fused AdaLN), parallelised (AC then FSDP2,
``parallel.mesh_torch``) and only then materialised: rank 0 alone reads the full weights (diffusers folder
or a seeded random initialisation) and broadcasts each rank its shards, so no other process ever holds a whole
expert. One process drives one device and feeds one data-parallel rank (context-parallel peers feed the same one).

A step runs the plan's slots in order: slot k goes through expert ``slot.expert`` on every rank (the per-rank
layout keeps experts in lockstep, so each expert's all-gathers and reduce-scatters match), gradients accumulate in
the sharded ``.grad`` and are summed over ranks, then every expert with samples takes one AdamW step.

With ``spec.lora`` an adapted expert's base is frozen in its parameter dtype and only its float32 adapters
(``model.lora_torch``) train: they alone have gradients, AdamW moments, EMA weights and checkpoint entries (the base
comes from ``model.weights`` at every start). An expert without adapters (``lora.experts`` naming the other) is
frozen whole and has no optimizer: the router sends it no samples.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE as _CHECKPOINT_WRAPPED,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from wanloom_trainer.backends.ema import ema_decay
from wanloom_trainer.backends.interface import ExpertOutputs, Restored, Slot, StepInputs, StepOutputs
from wanloom_trainer.backends.torch.step import accumulate, flow_matching_loss, make_adamw, rows_to_tensors, update
from wanloom_trainer.checkpoint.gcs import stage_weights
from wanloom_trainer.config.train_config import BackendConfig
from wanloom_trainer.distributed_torch import destroy_process_group, init_process_group
from wanloom_trainer.model.lora_torch import add_lora, freeze
from wanloom_trainer.model.wan_torch import (
    apply_adaln_impl,
    build_expert,
    expert_names,
    expert_subfolders,
    load_expert,
)
from wanloom_trainer.parallel.mesh_torch import (
    MixedPrecision,
    build_torch_mesh,
    parallelize_wan,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# spec.kernels.attention -> diffusers attention backend ("_native_flash": PyTorch's built-in FlashAttention kernel).
ATTENTION_BACKENDS = {"sdpa": "native", "flash": "_native_flash"}


@dataclass
class TorchState:
    """Per expert: the FSDP-wrapped diffusers model and its AdamW (updated in place by ``train_step``), and with
    ``spec.optimizer.ema`` the float32 average of its parameters by name (sharded like them; else empty)."""

    experts: tuple[nn.Module, ...]
    optimizers: tuple[torch.optim.AdamW | None, ...]  # None: an expert with nothing to train (LoRA on the other)
    ema: tuple[dict[str, torch.Tensor], ...] = ()


def expert_seed(seed: int, expert: int) -> int:
    """A distinct, reproducible initialisation seed per expert from the one training seed."""
    return int(np.random.SeedSequence([seed, expert]).generate_state(1)[0] >> 1)


class TorchBackend:
    """See the module docstring; one per process."""

    name = "torch"

    def __init__(self, config: BackendConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        if config.model.adaln == "fused":
            _enable_triton_interpreter_on_cpu()
        self._owns_group = not dist.is_initialized()
        self.proc = init_process_group(config.distributed, env)
        self.device = self.proc.device
        if self.device.type == "cpu":
            # CPU runs train tiny models, whose ops are far too small for intra-op threads: with two OpenMP
            # threads per process a step on a busy 2-core host ran ~25x slower than with one (181 vs 7 ms).
            torch.set_num_threads(1)
        # The one random stream a step draws from (LoRA dropout) starts from the job's seed on every rank, and
        # checkpoints carry it on: a rerun and a resumed run draw the same masks.
        torch.manual_seed(expert_seed(config.seed, 1000 + self.proc.rank))
        self.mesh = build_torch_mesh(config.parallel, self.proc.world_size, self.device.type)
        self.dp_rank, self.dp_size = self.mesh.data_parallel_rank()
        self.process_index, self.process_count = self.proc.rank, self.proc.world_size
        self.num_devices = self.proc.world_size
        self.precision = MixedPrecision(DTYPES[config.model.param_dtype], DTYPES[config.model.compute_dtype])
        self.names = expert_names(config.model.wan)
        self._store = None
        if config.checkpoint.uri is not None:
            from wanloom_trainer.checkpoint.dcp_checkpoint import CheckpointStore

            staging = Path(config.run_dir) / "checkpoint-staging"
            self._store = CheckpointStore(config.checkpoint.uri, keep=config.checkpoint.keep, staging_dir=staging)

    # -- model -----------------------------------------------------------------------------------------------------

    def _full_state_dict(self, expert: int) -> dict[str, torch.Tensor]:
        """Rank 0's full fp32 weights of one expert: the diffusers folder, or a seeded random initialisation."""
        variant, weights = self.config.model.wan, self.config.model.weights
        if weights is None:
            model = build_expert(variant, seed=expert_seed(self.config.seed, expert))
        else:
            if weights.startswith("gs://"):
                # Rank 0 alone reads full weights (it broadcasts them into the FSDP shards).
                local_root = Path(self.config.run_dir) / "weights"
                weights = str(stage_weights(weights, local_root, expert_subfolders(self.config.model.wan)))
            model = load_expert(Path(weights) / expert_subfolders(self.config.model.wan)[expert], variant)
        if self.config.adapted_experts[expert]:  # the adapters' initial values travel with the base weights
            add_lora(model, self.config.lora, seed=expert_seed(self.config.seed, 100 + expert))
        return model.state_dict()

    def _build_expert(self, expert: int) -> nn.Module:
        variant = self.config.model.wan
        with torch.device("meta"):
            model = WanTransformer3DModel(**variant.diffusers_config())
        model = apply_adaln_impl(model, self.config.model.adaln)
        if (attention := self._attention_backend()) != "native":  # native SDPA is diffusers' default
            model.set_attention_backend(attention)
        if self.precision.param_dtype != torch.float32:
            model.to(self.precision.param_dtype)  # bf16 masters: FSDP2 needs one dtype per sharded group
        if self.config.lora is not None:  # frozen base (any dtype), float32 adapters: FSDP2 checks trainable ones
            freeze(model)
            if self.config.adapted_experts[expert]:
                add_lora(model, self.config.lora, seed=0)  # on meta: the values come from rank 0's state dict
        parallelize_wan(
            model,
            mesh=self.mesh,
            remat=self.config.model.remat,
            mixed_precision=self.precision,
            compile=self.config.model.compile_blocks,
        )
        model.to_empty(device=self.device)
        full = self._full_state_dict(expert) if self.proc.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        _init_rope_buffers(model, self.device)
        return model

    def _attention_backend(self) -> str:
        attention = self.config.model.attention
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"spec.kernels.attention {attention!r}: the torch backend supports sdpa or flash")
        if attention == "flash" and (self.device.type != "cuda" or self._compute_dtype != torch.bfloat16):
            raise ValueError("spec.kernels.attention 'flash' needs CUDA devices and computeDtype bfloat16; use sdpa")
        return ATTENTION_BACKENDS[attention]

    # -- Backend protocol ------------------------------------------------------------------------------------------

    def local_ranks(self, num_ranks: int) -> list[int]:
        if num_ranks != self.dp_size:
            raise ValueError(
                f"the plan has {num_ranks} ranks but the torch mesh has {self.dp_size} data-parallel ranks"
            )
        return [self.dp_rank]

    def init_state(self) -> TorchState:
        experts = tuple(self._build_expert(e) for e in range(len(self.names)))
        optimizers = tuple(
            make_adamw(m.parameters(), self.config.optimizer) if trains else None
            for m, trains in zip(experts, self._trains, strict=True)
        )
        ema = tuple(ema_init(m) for m in experts) if self.config.optimizer.ema is not None else ()
        return TorchState(experts, optimizers, ema)

    def train_step(self, state: TorchState, inputs: StepInputs) -> tuple[TorchState, StepOutputs]:
        loss_sums = torch.zeros(len(state.experts), dtype=torch.float64, device=self.device)
        slot_seconds = []
        for slot in inputs.slots:
            started = time.perf_counter()
            rows = self._my_rows(slot)
            loss_sums[slot.expert] += accumulate(state.experts[slot.expert], rows, self.device, self._compute_dtype)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            slot_seconds.append(time.perf_counter() - started)
        norms: list[float | None] = [None] * len(state.experts)
        for e, (model, optimizer) in enumerate(zip(state.experts, state.optimizers, strict=True)):
            if optimizer is None:  # nothing of it trains (LoRA on the other expert): it never gets samples
                continue
            if inputs.expert_samples[e] > 0:
                norms[e] = update(model, optimizer, inputs.learning_rates[e], self.config.optimizer.clip_grad_norm)
            else:  # no samples anywhere this step: parameters and moments stay exactly as they were
                optimizer.zero_grad(set_to_none=True)
        if self.config.optimizer.ema is not None:
            decay = ema_decay(self.config.optimizer.ema, inputs.step)
            for model, average in zip(state.experts, state.ema, strict=True):
                if average:  # an expert that does not train has nothing to average
                    ema_update(average, model, decay)
        totals = self._sum_over_data_parallel(loss_sums)
        outputs = tuple(
            ExpertOutputs(inputs.expert_samples[e], float(totals[e]), norms[e], inputs.learning_rates[e])
            for e in range(len(state.experts))
        )
        return state, StepOutputs(outputs, tuple(slot_seconds))

    def evaluate(self, state: TorchState, slot: Slot) -> float:
        """Σ weights·loss of one slot through its expert, without gradients (the training loss), all ranks."""
        with torch.no_grad():
            batch = rows_to_tensors(self._my_rows(slot), self.device)
            loss, _ = flow_matching_loss(state.experts[slot.expert], **batch, compute_dtype=self._compute_dtype)
        return float(self._sum_over_data_parallel(torch.tensor([float(loss)], dtype=torch.float64))[0])

    def predict(self, state: TorchState, expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
        """Every rank runs the same inputs through its FSDP-wrapped expert (the all-gathers need every rank)."""
        dtype = self._compute_dtype
        with torch.no_grad():
            out = state.experts[expert](
                torch.from_numpy(x).to(self.device, dtype),
                torch.from_numpy(t).to(self.device, torch.float32),
                torch.from_numpy(text).to(self.device, dtype),
                return_dict=False,
            )[0]
        return out.float().cpu().numpy()

    def save(self, state: TorchState, next_step: int, meta: Mapping[str, Any]) -> float:
        """Checkpoint both experts, optimizers and RNG with ``meta``; returns the seconds it took."""
        from wanloom_trainer.checkpoint.dcp_checkpoint import training_state

        if self._store is None:
            raise ValueError("spec.training.checkpoint.uri is unset: checkpoints are disabled")
        start = time.perf_counter()
        self._store.save(training_state(*self._by_name(state), ema=self._ema_by_name(state)), next_step, meta)
        return time.perf_counter() - start

    def checkpoint_pending(self) -> bool:
        return False  # DCP saves synchronously: save() returns once the checkpoint is committed

    def wait_checkpoint(self) -> None:
        return None

    def restore(self, state: TorchState | None = None) -> Restored | None:
        from wanloom_trainer.checkpoint.dcp_checkpoint import apply_training_state, training_state

        if self._store is None or (step := self._store.latest_step()) is None:
            return None
        state = state if state is not None else self.init_state()
        # EMA tensors load in place (the state dict holds them, not copies).
        loaded = training_state(*self._by_name(state), ema=self._ema_by_name(state))
        record = self._store.load(loaded, step)
        apply_training_state(loaded, *self._by_name(state))
        return Restored(state, int(record["next_step"]), record["meta"])

    def gather_floats(self, value: float) -> list[float]:
        return self.gather_rows([value])[:, 0].tolist()

    def gather_rows(self, values: Sequence[float]) -> np.ndarray:
        if self.proc.world_size == 1:  # no collective for a one-process job
            return np.asarray([values], dtype=np.float64)
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.proc.world_size)]
        dist.all_gather(every, mine)
        return torch.stack(every).cpu().numpy()

    def broadcast_floats(self, values: Sequence[float]) -> list[float]:
        if self.proc.world_size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor.cpu().tolist()

    def close(self) -> None:
        """Checkpoints are written synchronously: nothing is pending. Release the process group if this backend
        created it (no barrier: after a failure on one rank, the others may never reach it)."""
        if self._owns_group:
            destroy_process_group()

    # -- helpers ---------------------------------------------------------------------------------------------------

    @property
    def _compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    def _my_rows(self, slot: Slot) -> Any:
        if self.dp_rank not in slot.ranks:
            raise ValueError(f"slot for expert {slot.expert} has no rows for data-parallel rank {self.dp_rank}")
        return slot.ranks[self.dp_rank]

    @property
    def _trains(self) -> tuple[bool, ...]:
        """Per expert: has it parameters to train (all of them, or with LoRA its adapters)?"""
        return tuple(self.config.lora is None or a for a in self.config.adapted_experts)

    def _by_name(self, state: TorchState) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """The experts that train, by name (a frozen expert has nothing to checkpoint: it is its base weights)."""
        experts = {n: m for n, m, t in zip(self.names, state.experts, self._trains, strict=True) if t}
        optimizers = {n: o for n, o in zip(self.names, state.optimizers, strict=True) if o is not None}
        return experts, optimizers

    def _ema_by_name(self, state: TorchState) -> dict[str, dict[str, torch.Tensor]]:
        """EMA weights of the experts that train (a frozen expert's average would be empty)."""
        return {name: ema for name, ema in zip(self.names, state.ema, strict=True) if ema} if state.ema else {}

    def _sum_over_data_parallel(self, values: torch.Tensor) -> torch.Tensor:
        """Σ over data-parallel ranks: an all-reduce over every rank, divided by the context-parallel peers that
        computed the same samples' loss."""
        total = values.to(self.device)
        if self.proc.world_size > 1:
            dist.all_reduce(total)
        return (total / (self.proc.world_size // self.dp_size)).cpu()


def _parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trained parameters by their state-dict (diffusers) name: activation checkpointing's wrapper adds a path
    component. With LoRA only the adapters train."""
    return {name.replace(f"{_CHECKPOINT_WRAPPED}.", ""): p for name, p in model.named_parameters() if p.requires_grad}


def ema_init(model: nn.Module) -> dict[str, torch.Tensor]:
    """A float32 copy of every parameter, by state-dict name (FSDP2 DTensors stay sharded: each rank its shards)."""
    return {name: p.detach().to(torch.float32, copy=True) for name, p in _parameters(model).items()}


@torch.no_grad()
def ema_update(average: dict[str, torch.Tensor], model: nn.Module, decay: float) -> None:
    """``average += (1 - decay) * (weights - average)``, in place, one fused call over all tensors."""
    params = _parameters(model)
    names = list(average)
    torch._foreach_lerp_([average[n] for n in names], [params[n].detach().float() for n in names], 1.0 - decay)


def _init_rope_buffers(model: nn.Module, device: torch.device) -> None:
    """RoPE tables are non-persistent buffers (not in any state dict): recompute them after meta materialisation."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = model.rope
    fresh = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    for name, buffer in fresh.named_buffers():
        getattr(rope, name).copy_(buffer.to(device))


def _enable_triton_interpreter_on_cpu() -> None:
    """``kernels.adaln: fused`` on a CPU-only host runs Triton's interpreter, which is chosen at Triton's import."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
