"""The step plan: what every data-parallel rank runs in one global step. The contract with both trainers.

Loss normalisation (the reason ranks may hold unequal batches): every real sample carries a loss weight in
``MicroBatch.weights`` that does not depend on its rank or micro-batch — ``1 / globalBatch`` for the balanced
scheduler (its tokens / (globalBatch × mean tokens) with ``stepBudget: tokens``; ``planner`` module docstring), ``1 /
StepPlan.num_samples`` for the bucket-chunk policies — and padding rows carry 0. A rank computes
``Σ_micro-batches Σ_i weights[i] · loss_i`` (``loss_i`` the sample's own mean over its elements), back-propagates
it, and gradients are **summed** across ranks: the gradient of the step's weighted sum, whatever the per-rank batch
sizes. A backend whose all-reduce averages over R ranks (FSDP's default reduce-scatter) must
multiply the loss by R (or set its gradient divide factor to 1).

Two layouts:

- ``per-rank`` (PyTorch FSDP): each rank runs its own shapes. Every rank runs the same number of micro-batches,
  and micro-batch k has the same ``expert`` on every rank, so the collectives of each expert's FSDP modules stay in
  lockstep; a rank short of work runs *dummy* micro-batches (``sample_ids == ()``): one zero-weight row of
  ``latent_shape`` (zeros, or any sample of that shape), counted in ``predicted_cost``.
- ``spmd`` (JAX): micro-batch k has the same ``latent_shape``, ``expert`` and row count on every rank; missing rows
  are duplicates of real samples with weight 0. With the balanced policy the SPMD micro-batches are **packed**
  (``MicroBatch.packed``, ``adaptiveload.assignment.packing``): each rank runs one row of ``row_tokens`` tokens holding
  samples of any shapes end to end; micro-batch k has the same ``PackedRow`` geometry (row tokens, segment slots,
  longest segment) on every rank, so it is still one SPMD program.

Costs: ``MicroBatch.predicted_cost`` is the compute of its rows (rows × the cost model's per-sample cost, padding
included); ``RankPlan.predicted_cost`` adds the cost model's per-call overhead once per micro-batch, i.e. it is the
rank's predicted busy time in the cost model's unit (seconds for fitted or FLOP-rate models).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HIGH_NOISE_EXPERT = 0  # diffusers transformer/ (also the only expert of single-model variants)
LOW_NOISE_EXPERT = 1  # diffusers transformer_2/
LAYOUTS = ("per-rank", "spmd")
POLICIES = ("balanced", "paper", "equal-tokens")


@dataclass(frozen=True)
class PackedRow:
    """Geometry of a packed micro-batch (docs/architecture.md, "Packed sequences"); identical across a slot's ranks.

    Attributes:
        row_tokens: tokens of the row, padding included.
        groups: segment slots (samples + padding, rounded up to a power of two).
        max_segment_tokens: bound on any segment's tokens (the attention kernel's grid).
        sample_shapes: (T', H', W') of each of the rank's samples, in row order (the loader fits each to its own).
        sample_tokens: transformer tokens of each sample.
    """

    row_tokens: int
    groups: int
    max_segment_tokens: int
    sample_shapes: tuple[tuple[int, int, int], ...] = ()
    sample_tokens: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "row_tokens": self.row_tokens,
            "groups": self.groups,
            "max_segment_tokens": self.max_segment_tokens,
            "sample_shapes": [list(s) for s in self.sample_shapes],
            "sample_tokens": list(self.sample_tokens),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PackedRow:
        return cls(
            row_tokens=int(doc["row_tokens"]),
            groups=int(doc["groups"]),
            max_segment_tokens=int(doc["max_segment_tokens"]),
            sample_shapes=tuple(tuple(int(x) for x in s) for s in doc.get("sample_shapes", ())),  # type: ignore[misc]
            sample_tokens=tuple(int(t) for t in doc.get("sample_tokens", ())),
        )


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward call: shape- and expert-homogeneous, so the rows stack into one tensor.

    Attributes:
        sample_ids: dataset sample ids (``SampleShapes.ids``) the loader fetches, one per row; padding rows repeat
            a real id; () for a dummy micro-batch.
        latent_shape: (T', H', W') of every row: the bucket the loader resizes/crops to.
        expert: 0 = high-noise (transformer/), 1 = low-noise (transformer_2/); 0 for single-model variants.
        timesteps: per-row t in [0, 1000), float32 values (exactly representable), from routing.
        weights: per-row loss weight (module docstring), 0.0 for padding.
        tokens: transformer tokens per row.
        predicted_cost: rows × per-sample cost (compute only, no per-call overhead); packed: the row's samples'
            costs plus its padding's.
        packed: the packed-row geometry, or None for a micro-batch of same-shape rows.
    """

    sample_ids: tuple[int, ...]
    latent_shape: tuple[int, int, int]
    expert: int
    timesteps: tuple[float, ...]
    weights: tuple[float, ...]
    tokens: int = 0
    predicted_cost: float = 0.0
    packed: PackedRow | None = None

    @property
    def is_dummy(self) -> bool:
        return not self.sample_ids

    @property
    def rows(self) -> int:
        """Rows the backend runs (a dummy runs one zero-weight row; a packed micro-batch is one row)."""
        return 1 if self.packed is not None else max(1, len(self.sample_ids))

    @property
    def real_tokens(self) -> tuple[int, ...]:
        """Transformer tokens of each real sample."""
        per_sample = self.packed.sample_tokens if self.packed is not None else (self.tokens,) * len(self.weights)
        return tuple(t for t, w in zip(per_sample, self.weights, strict=True) if w > 0)

    @property
    def num_real(self) -> int:
        return sum(1 for w in self.weights if w > 0)

    def validate(self) -> None:
        n = len(self.sample_ids)
        if len(self.timesteps) != n or len(self.weights) != n:
            raise ValueError(
                f"micro-batch has {n} sample_ids but {len(self.timesteps)} timesteps and {len(self.weights)} weights"
            )
        if self.expert not in (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT):
            raise ValueError(f"expert must be 0 or 1, got {self.expert}")
        if len(self.latent_shape) != 3 or min(self.latent_shape) < 1:
            raise ValueError(f"latent_shape must be three positive ints, got {self.latent_shape}")
        if any(not 0.0 <= t < 1000.0 for t in self.timesteps):
            raise ValueError(f"timesteps must lie in [0, 1000), got {self.timesteps}")
        if self.packed is not None and not len(self.packed.sample_shapes) == len(self.packed.sample_tokens) == n:
            raise ValueError(f"packed micro-batch has {n} samples but {len(self.packed.sample_shapes)} shapes")
        if self.packed is not None and sum(self.packed.sample_tokens) > self.packed.row_tokens:
            raise ValueError(f"packed samples hold {sum(self.packed.sample_tokens)} tokens > {self.packed.row_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_ids": list(self.sample_ids),
            "latent_shape": list(self.latent_shape),
            "expert": self.expert,
            "timesteps": list(self.timesteps),
            "weights": list(self.weights),
            "tokens": self.tokens,
            "predicted_cost": self.predicted_cost,
            "packed": None if self.packed is None else self.packed.to_dict(),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MicroBatch:
        mb = cls(
            sample_ids=tuple(int(i) for i in doc["sample_ids"]),
            latent_shape=tuple(int(x) for x in doc["latent_shape"]),  # type: ignore[arg-type]
            expert=int(doc["expert"]),
            timesteps=tuple(float(t) for t in doc["timesteps"]),
            weights=tuple(float(w) for w in doc["weights"]),
            tokens=int(doc.get("tokens", 0)),
            predicted_cost=float(doc.get("predicted_cost", 0.0)),
            packed=None if doc.get("packed") is None else PackedRow.from_dict(doc["packed"]),
        )
        mb.validate()
        return mb


@dataclass(frozen=True)
class RankPlan:
    """One data-parallel rank's micro-batches, run in order with gradient accumulation."""

    micro_batches: tuple[MicroBatch, ...]
    predicted_cost: float

    @property
    def num_samples(self) -> int:
        return sum(mb.num_real for mb in self.micro_batches)

    @property
    def compute_cost(self) -> float:
        """Predicted compute load (no per-call overhead): what the load-balance CV is computed over."""
        return sum(mb.predicted_cost for mb in self.micro_batches)

    @property
    def tokens(self) -> int:
        """Tokens of the real samples."""
        return sum(sum(mb.real_tokens) for mb in self.micro_batches)

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batches": [mb.to_dict() for mb in self.micro_batches], "predicted_cost": self.predicted_cost}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankPlan:
        mbs = tuple(MicroBatch.from_dict(m) for m in doc["micro_batches"])
        return cls(micro_batches=mbs, predicted_cost=float(doc["predicted_cost"]))


@dataclass(frozen=True)
class StepPlan:
    """All ranks' work for global step ``step``.

    Attributes:
        step: global step index.
        ranks: one RankPlan per data-parallel rank.
        num_samples: real samples in the step over all ranks: the loss normaliser.
        layout: "per-rank" or "spmd" (module docstring).
        policy: "balanced", "paper" or "equal-tokens".
    """

    step: int
    ranks: tuple[RankPlan, ...]
    num_samples: int
    layout: str = "per-rank"
    policy: str = "balanced"

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ranks)

    @property
    def expert_samples(self) -> tuple[int, int]:
        """Real samples per expert over all ranks."""
        counts = [0, 0]
        for rank in self.ranks:
            for mb in rank.micro_batches:
                counts[mb.expert] += mb.num_real
        return counts[0], counts[1]

    @property
    def token_counts(self) -> tuple[tuple[int, int], ...]:
        """(tokens, real samples with that many tokens) over all ranks, for FLOP counts."""
        counts = Counter(t for r in self.ranks for mb in r.micro_batches for t in mb.real_tokens)
        return tuple(sorted(counts.items()))

    @property
    def rank_costs(self) -> tuple[float, ...]:
        """Each rank's predicted busy time (``RankPlan.predicted_cost``)."""
        return tuple(r.predicted_cost for r in self.ranks)

    def validate(self) -> None:
        """Check the layout invariants (module docstring); raise ValueError naming the violated one."""
        counts = {len(r.micro_batches) for r in self.ranks}
        if len(counts) > 1:
            raise ValueError(f"step {self.step}: ranks run different numbers of micro-batches {sorted(counts)}")
        real = sum(r.num_samples for r in self.ranks)
        if real != self.num_samples:
            raise ValueError(f"step {self.step}: num_samples {self.num_samples} but the ranks hold {real} real rows")
        for k, slot in enumerate(zip(*(r.micro_batches for r in self.ranks), strict=True)):
            for mb in slot:
                mb.validate()
            if len({mb.expert for mb in slot}) > 1:
                raise ValueError(f"step {self.step}: micro-batch {k} mixes experts across ranks")
            if self.layout == "spmd" and len({_program_shape(mb) for mb in slot}) > 1:
                raise ValueError(f"step {self.step}: spmd micro-batch {k} differs in shape or rows across ranks")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ranks": [r.to_dict() for r in self.ranks],
            "num_samples": self.num_samples,
            "layout": self.layout,
            "policy": self.policy,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StepPlan:
        plan = cls(
            step=int(doc["step"]),
            ranks=tuple(RankPlan.from_dict(r) for r in doc["ranks"]),
            num_samples=int(doc["num_samples"]),
            layout=str(doc.get("layout", "per-rank")),
            policy=str(doc.get("policy", "balanced")),
        )
        plan.validate()
        return plan


def _program_shape(mb: MicroBatch) -> tuple[Any, ...]:
    """What one SPMD program fixes: the row geometry of a packed micro-batch, else the latent shape and rows."""
    if mb.packed is not None:
        return ("packed", mb.packed.row_tokens, mb.packed.groups, mb.packed.max_segment_tokens)
    return (mb.latent_shape, mb.rows)


@dataclass(frozen=True)
class LocalPlan:
    """Global step ``step`` as one trainer process needs it: its own ranks' micro-batches and the step's global
    totals, built without materialising the other ranks' micro-batches (``Planner.plan_local``). Offers what the
    driver reads of a ``StepPlan``.

    Attributes:
        step: global step index.
        ranks: this process's data-parallel ranks → their RankPlans.
        num_samples: real samples of the step over all ranks (the loss normaliser).
        expert_samples: real samples per expert over all ranks (which experts update).
        token_counts: (tokens, real samples) over all ranks (FLOPs and tokens/s).
        rank_costs: every rank's predicted busy time (the predicted-imbalance metrics).
        slot_work: per slot, the token counts of the samples in its predicted-heaviest cell, padding included
            (``layout.critical_work``): what the slot's measured time is fitted against (``adaptiveload.cost.refit``).
        layout, policy: as in ``StepPlan``.
    """

    step: int
    ranks: Mapping[int, RankPlan]
    num_samples: int
    expert_samples: tuple[int, int]
    token_counts: tuple[tuple[int, int], ...]
    rank_costs: tuple[float, ...]
    slot_work: tuple[tuple[int, ...], ...] = ()
    layout: str = "per-rank"
    policy: str = "balanced"

    @property
    def tokens(self) -> int:
        return sum(t * n for t, n in self.token_counts)
