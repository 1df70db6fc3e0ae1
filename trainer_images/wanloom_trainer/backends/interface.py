"""The Backend protocol: what the backend-agnostic driver (``train.run``) asks of a framework.

A backend owns the framework: devices and process group, both experts' parameters and optimizer states, the
jitted/compiled step, and checkpoint I/O. The driver owns everything else: planning (AdaptiveLoad), routing,
loading, noise, the learning-rate schedule, metrics, the loss log and the checkpoint cadence. Inputs cross the
boundary as numpy arrays, so the JAX (``backend_jax.JaxBackend``) and PyTorch (``backend_torch``) backends see
identical numbers for identical plans.

One step, as the driver calls it::

    inputs = StepInputs(step, slots, num_samples, expert_samples, learning_rates)
    state, out = backend.train_step(state, inputs)

``slots[k]`` is micro-batch slot k of the step's plan: one expert, and for each data-parallel rank this process
feeds (``backend.local_ranks``), that rank's rows. A backend accumulates gradients over the slots (per expert),
then applies AdamW to every expert with ``expert_samples[e] > 0``; an expert with no samples keeps its parameters
and optimizer state bit for bit (per-batch routing: exactly one expert moves per step).

Loss contract (``adaptiveload.plan``): the gradient is that of Σ_slots Σ_rows ``weights[i] · loss_i`` with
``loss_i`` the row's mean squared velocity error; ``weights`` hold the plan's normaliser (0 for padding rows) times
the routing loss weight, and gradients are summed (not averaged) over ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class RankRows:
    """One rank's rows of a micro-batch slot (host arrays; b rows, all of one latent shape).

    Attributes:
        sample_ids: int64 [b] dataset ids (padding rows repeat a real id).
        latents: float32 [b, C, T', H', W'] clean latents x0.
        text: float32 [b, L, D_text] text-encoder states.
        noise: float32 [b, C, T', H', W'] ε (``objective.batch_noise``).
        timesteps: float32 [b] t in [0, 1000).
        weights: float32 [b] loss weights (0 for padding rows).
        condition: float32 [b, Cc, T', H', W'] image condition (I2V: mask + first-frame latents), concatenated
            after x_t on the channel axis as the model's input; None for text-to-video.
        clean_first_frame: float32 [b], unified TI2V models only: 1 for rows trained as image-to-video (first
            latent frame clean, t = 0 on its tokens, out of the loss; ``backends.objective``); None otherwise.
    """

    sample_ids: np.ndarray
    latents: np.ndarray
    text: np.ndarray
    noise: np.ndarray
    timesteps: np.ndarray
    weights: np.ndarray
    condition: np.ndarray | None = None
    clean_first_frame: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.sample_ids)


@dataclass(frozen=True)
class Slot:
    """Micro-batch slot k: one expert; ``ranks`` maps each rank this process feeds to its rows, or to its packed
    row (``backends.packing.PackedRows``: the JAX backend's balanced layout)."""

    expert: int
    ranks: Mapping[int, Any]


@dataclass(frozen=True)
class StepInputs:
    """Everything one optimizer step consumes.

    Attributes:
        step: global step index (0-based).
        slots: the plan's micro-batch slots in order.
        num_samples: real samples of the whole step over all ranks.
        expert_samples: real samples per expert over all ranks (decides which experts update).
        learning_rates: per expert, already scheduled and scaled (``train.schedule``).
    """

    step: int
    slots: Sequence[Slot]
    num_samples: int
    expert_samples: tuple[int, ...]
    learning_rates: tuple[float, ...]


@dataclass(frozen=True)
class ExpertOutputs:
    """One expert's share of a step. ``loss_sum`` = Σ weights·loss_i over its rows (all ranks); grad_norm is the
    global L2 norm before clipping (None when the expert did not update)."""

    samples: int
    loss_sum: float
    grad_norm: float | None
    learning_rate: float

    @property
    def updated(self) -> bool:
        return self.samples > 0


@dataclass(frozen=True)
class StepOutputs:
    """Per expert outputs; ``slot_seconds``: each slot's forward and backward on this process, the device
    synchronised at the slot's end, before the gradient update (their sum is the process's busy time);
    ``slot_compiled``: the slots whose time includes compiling their program (not a step-time measurement);
    ``compile_seconds``: the step's time spent tracing and compiling programs (0 for a steady-state step)."""

    experts: tuple[ExpertOutputs, ...]
    slot_seconds: tuple[float, ...] = ()
    slot_compiled: tuple[bool, ...] = ()
    compile_seconds: float = 0.0

    @property
    def busy_seconds(self) -> float:
        return sum(self.slot_seconds)

    @property
    def loss(self) -> float:
        """The step's loss: Σ over experts of their weighted loss sums (weights carry the plan's normaliser)."""
        return sum(e.loss_sum for e in self.experts)


@dataclass(frozen=True)
class Restored:
    """A restored checkpoint: the state, the first step still to run, and the driver's bookkeeping."""

    state: Any
    next_step: int
    meta: Mapping[str, Any]


class Backend(Protocol):
    """A training framework behind the driver. ``State`` is backend-defined and opaque to the driver."""

    name: str
    process_index: int
    process_count: int
    num_devices: int

    def local_ranks(self, num_ranks: int) -> Sequence[int]:
        """Data-parallel ranks (0..num_ranks-1) whose rows this process must load, in ascending order."""
        ...

    def init_state(self) -> Any:
        """Both experts (random or ``model.weights``) and fresh optimizer states, placed on the devices."""
        ...

    def train_step(self, state: Any, inputs: StepInputs) -> tuple[Any, StepOutputs]:
        """Accumulate gradients over the slots, update the experts that got samples; see the module docstring."""
        ...

    def evaluate(self, state: Any, slot: Slot) -> float:
        """Σ weights·loss of one slot through its expert, without gradients, summed over all ranks."""
        ...

    def predict(self, state: Any, expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
        """The expert's velocity (float32 [B, C_out, ...]) for model inputs x [B, C_in, T', H', W'], t [B] and
        text [B, L, D]: every process calls it with the same arrays and gets the whole result (sampling)."""
        ...

    def save(self, state: Any, next_step: int, meta: Mapping[str, Any]) -> float:
        """Checkpoint (atomically) everything needed to resume at ``next_step``; ``meta`` is JSON-serialisable.
        May finish in the background; returns the seconds the caller was blocked."""
        ...

    def checkpoint_pending(self) -> bool:
        """True while a checkpoint ``save`` started is still being written (not yet committed). It turns False on
        its own: the run polls it rather than block in ``wait_checkpoint`` (train/saves.py says why)."""
        ...

    def wait_checkpoint(self) -> None:
        """Block until the last checkpoint ``save`` started is committed; raise what its background write raised."""
        ...

    def restore(self, state: Any | None = None) -> Restored | None:
        """The latest checkpoint, or None when checkpoints are disabled or none exists yet. With ``state`` None
        the backend restores without a template (JAX reads straight into its shardings, no initialisation)."""
        ...

    def gather_floats(self, value: float) -> list[float]:
        """``value`` from every process, in process order (e.g. a flag any process may raise)."""
        ...

    def gather_rows(self, values: Sequence[float]) -> np.ndarray:
        """float64 [processes, n]: every process's ``values`` (n alike everywhere), in process order."""
        ...

    def broadcast_floats(self, values: Sequence[float]) -> list[float]:
        """Process 0's ``values`` on every process (n alike everywhere)."""
        ...

    def close(self) -> None:
        """Wait for pending checkpoint writes and release resources."""
        ...
