"""Step-time models of one micro-batch of B samples with S tokens each, and their fit to measured timings.

- ``PowerCost``: the AdaptiveLoad paper's ``t = a + b·B·S^p`` (arXiv 2605.17923, §cost fitting).
- ``TwoTermCost``: ``t = a + B·(α·S + β·S²)``, the linear layers plus attention; one exponent cannot follow the
  drift from ~1 (images) to ~2 (long clips), two terms can.
- ``FlopCost``: the analytic Wan FLOP count (``wanloom_trainer.flops``) at an assumed sustained FLOP rate; used when
  no shape benchmark exists.

``a`` is a fixed overhead paid once per micro-batch (a forward/backward call: launches, FSDP all-gathers);
``sample_cost(S)`` is the marginal cost of one sample. ``fit_timings`` fits both families by non-linear least
squares on relative residuals (timings span orders of magnitude) and picks the one with the lower k-fold held-out
error. A measurement may mix sequence lengths (a packed row, a lockstep slot): ``Timings`` holds the work of each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from scipy import optimize

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.flops import train_flop_coefficients

_LOG_B_BOUND = 80.0
_P_BOUNDS = (0.3, 4.0)


class CostModel(Protocol):
    kind: str
    overhead: float

    def sample_cost(self, tokens: np.ndarray) -> np.ndarray: ...

    def to_dict(self) -> dict[str, Any]: ...


def predict(model: CostModel, batch: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Predicted time of a micro-batch: a + B·sample_cost(S) (broadcasts)."""
    return model.overhead + np.asarray(batch, dtype=np.float64) * model.sample_cost(tokens)


@dataclass(frozen=True)
class PowerCost:
    """t = a + b·B·S^p."""

    a: float
    b: float
    p: float
    kind: str = "power"

    @property
    def overhead(self) -> float:
        return self.a

    def sample_cost(self, tokens: np.ndarray) -> np.ndarray:
        return self.b * np.asarray(tokens, dtype=np.float64) ** self.p

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TwoTermCost:
    """t = a + B·(α·S + β·S²)."""

    a: float
    alpha: float
    beta: float
    kind: str = "two-term"

    @property
    def overhead(self) -> float:
        return self.a

    def sample_cost(self, tokens: np.ndarray) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        return self.alpha * s + self.beta * s * s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FlopCost:
    """Analytic cost: training FLOPs of the variant divided by ``flops_per_second`` (overhead ``a`` seconds)."""

    variant: str
    flops_per_second: float
    a: float = 0.0
    kind: str = "flops"

    def __post_init__(self) -> None:
        get_variant(self.variant)
        if self.flops_per_second <= 0:
            raise ValueError(f"flops_per_second must be positive, got {self.flops_per_second}")

    @property
    def overhead(self) -> float:
        return self.a

    def sample_cost(self, tokens: np.ndarray) -> np.ndarray:
        c0, c1, c2 = train_flop_coefficients(get_variant(self.variant))
        s = np.asarray(tokens, dtype=np.float64)
        return (c0 + c1 * s + c2 * s * s) / self.flops_per_second

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_KINDS = {"power": PowerCost, "two-term": TwoTermCost, "flops": FlopCost}


def cost_model_from_dict(doc: dict[str, Any]) -> CostModel:
    kind = doc.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"cost model kind {kind!r} is not one of {', '.join(_KINDS)}")
    return _KINDS[kind](**doc)


def effective_exponent(model: CostModel, tokens: np.ndarray) -> float:
    """p of the power law b·S^p closest (in log space) to ``model.sample_cost`` over ``tokens``.

    The paper's compute constraint B·S^p ≤ M_comp needs one exponent; for a two-term or FLOP model this is the
    exponent that best matches it over the shapes actually present.
    """
    s = np.unique(np.asarray(tokens, dtype=np.float64))
    if isinstance(model, PowerCost):
        return model.p
    if len(s) < 2:
        return 1.0
    slope, _ = np.polyfit(np.log(s), np.log(model.sample_cost(s)), 1)
    return float(slope)


@dataclass(frozen=True)
class FitQuality:
    """Relative RMS errors (fraction of the measured time) on the fitted points and k-fold held out; R² on all."""

    rmse_rel: float
    heldout_rmse_rel: float
    r2: float


@dataclass(frozen=True)
class CostFit:
    model: CostModel
    quality: dict[str, FitQuality]  # per candidate kind
    candidates: dict[str, CostModel]

    def summary(self) -> str:
        lines = [f"chosen: {self.model.kind}"]
        for kind, q in self.quality.items():
            params = ", ".join(f"{k}={v:.4g}" for k, v in self.candidates[kind].to_dict().items() if k != "kind")
            lines.append(
                f"  {kind:8s} {params}  rmse {q.rmse_rel:.2%}  held-out {q.heldout_rmse_rel:.2%}  R² {q.r2:.4f}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class Timings:
    """Measured work: measurement i ran Σ_j count[j] samples of tokens[j] tokens (over j with group[j] == i) in
    seconds[i]. A shape-benchmark point is one group (B samples of S); a packed row or a lockstep slot is one group
    of several sequence lengths.
    """

    tokens: np.ndarray
    count: np.ndarray
    group: np.ndarray
    seconds: np.ndarray

    @classmethod
    def of_micro_batches(cls, batch: Any, tokens: Any, seconds: Any) -> Timings:
        """One measurement per (B, S, t) point."""
        b, s, t = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (batch, tokens, seconds))
        if not len(b) == len(s) == len(t):
            raise ValueError(f"batch, tokens and seconds differ in length: {len(b)}, {len(s)}, {len(t)}")
        return cls(s, b, np.arange(len(t)), t)

    @classmethod
    def of_work(cls, work: Sequence[Sequence[int]], seconds: Sequence[float]) -> Timings:
        """One measurement per work item: the token counts of the samples it ran (one entry per sample)."""
        if len(work) != len(seconds):
            raise ValueError(f"{len(work)} work items but {len(seconds)} timings")
        tokens = np.array([x for w in work for x in w], dtype=np.float64)
        group = np.repeat(np.arange(len(work)), [len(w) for w in work])
        return cls(tokens, np.ones_like(tokens), group, np.asarray(seconds, dtype=np.float64))

    def __len__(self) -> int:
        return len(self.seconds)

    def take(self, measurements: np.ndarray) -> Timings:
        """The subset of ``measurements`` (indices), renumbered 0..len-1."""
        renumber = np.full(len(self.seconds), -1)
        renumber[measurements] = np.arange(len(measurements))
        keep = renumber[self.group] >= 0
        return Timings(self.tokens[keep], self.count[keep], renumber[self.group[keep]], self.seconds[measurements])

    def totals(self, per_sample: np.ndarray) -> np.ndarray:
        """Σ count·per_sample per measurement."""
        return np.bincount(self.group, weights=self.count * per_sample, minlength=len(self.seconds))

    def predict(self, model: CostModel) -> np.ndarray:
        """Predicted seconds of every measurement: a + Σ count·sample_cost(tokens)."""
        return model.overhead + self.totals(model.sample_cost(self.tokens))


def _token_scale(s: np.ndarray) -> float:
    """Geometric mean of the token counts: fitting in these units keeps S and S² near 1 whatever the model size."""
    return float(np.exp(np.mean(np.log(s))))


def _fit_power(m: Timings) -> PowerCost:
    scale = _token_scale(m.tokens)
    x, t = m.tokens / scale, m.seconds

    def residual(theta: np.ndarray) -> np.ndarray:
        a, log_b, p = theta
        return (a + np.exp(log_b) * m.totals(x**p) - t) / t

    starts = [_power_start(m, x, p) for p in (1.0, 1.5, 2.0)]
    bounds = ([0.0, -_LOG_B_BOUND, _P_BOUNDS[0]], [np.inf, _LOG_B_BOUND, _P_BOUNDS[1]])
    best = min((optimize.least_squares(residual, x0, bounds=bounds) for x0 in starts), key=lambda r: r.cost)
    a, log_b, p = best.x
    return PowerCost(a=float(a), b=float(np.exp(log_b) / scale**p), p=float(p))


def _power_start(m: Timings, x: np.ndarray, p: float) -> np.ndarray:
    """Linear least squares for (a, b) at a fixed p: a starting point for the non-linear fit."""
    t = m.seconds
    design = np.stack([np.ones_like(t), m.totals(x**p)], axis=1) / t[:, None]
    (a, coef), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    log_b = np.clip(np.log(max(coef, 1e-300)), -_LOG_B_BOUND + 1, _LOG_B_BOUND - 1)
    return np.array([max(a, 0.0), log_b, p])


def _linear_fit(design: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the relative residuals (design @ θ − t) / t."""

    def residual(theta: np.ndarray) -> np.ndarray:
        return (design @ theta - t) / t

    x0, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    return optimize.least_squares(residual, np.maximum(x0, 0.0), bounds=(0.0, np.inf)).x


def _fit_two_term(m: Timings) -> TwoTermCost:
    scale = _token_scale(m.tokens)
    x = m.tokens / scale
    design = np.stack([np.ones_like(m.seconds), m.totals(x), m.totals(x * x)], axis=1)
    a, alpha, beta = _linear_fit(design, m.seconds)
    return TwoTermCost(a=float(a), alpha=float(alpha / scale), beta=float(beta / scale**2))


def _flops_fitter(variant: str) -> Callable[[Timings], FlopCost]:
    """The analytic FLOP model with its two free numbers fitted: the per-call overhead and the sustained rate."""

    def fit(m: Timings) -> FlopCost:
        per_sample = FlopCost(variant, 1.0).sample_cost(m.tokens)
        unit = float(np.median(per_sample))  # FLOPs in units near 1, like the token scale of the other fits
        design = np.stack([np.ones_like(m.seconds), m.totals(per_sample / unit)], axis=1)
        a, seconds_per_unit = _linear_fit(design, m.seconds)
        return FlopCost(variant, unit / max(float(seconds_per_unit), 1e-300), a=float(a))

    return fit


_FITTERS: dict[str, Callable[[Timings], CostModel]] = {"power": _fit_power, "two-term": _fit_two_term}


def relative_rmse(predicted: np.ndarray, seconds: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((predicted - seconds) / seconds) ** 2)))


def _quality(fitter: Callable[[Timings], CostModel], model: CostModel, m: Timings, folds: int, seed: int) -> FitQuality:
    t = m.seconds
    pred = m.predict(model)
    order = np.random.default_rng(seed).permutation(len(t))
    held = np.empty_like(t)
    for fold in np.array_split(order, folds):
        train = np.setdiff1d(order, fold)
        held[fold] = m.take(fold).predict(fitter(m.take(train)))
    r2 = 1.0 - np.sum((pred - t) ** 2) / np.sum((t - t.mean()) ** 2)
    return FitQuality(rmse_rel=relative_rmse(pred, t), heldout_rmse_rel=relative_rmse(held, t), r2=float(r2))


def fit_timings(m: Timings, kind: str = "auto", folds: int = 5, seed: int = 0, analytic: str | None = None) -> CostFit:
    """Fit step-time models to measured work.

    Args:
        m: ≥ 6 measurements over ≥ 3 distinct sequence lengths, so both families are identifiable.
        kind: "power", "two-term" or "auto" (both fitted, the lower held-out error chosen).
        folds: k of the k-fold held-out error (capped at the number of measurements).
        analytic: a variant name: also fit the analytic FLOP model's overhead and rate (candidate "flops", never
            chosen: the yardstick a fitted model must beat).

    Returns:
        The chosen model, every candidate and its fit quality.
    """
    if len(m) < 6 or len(np.unique(m.tokens)) < 3:
        raise ValueError(
            f"need >= 6 timings over >= 3 sequence lengths to fit, got {len(m)} over {len(np.unique(m.tokens))}"
        )
    if (m.seconds <= 0).any() or (m.count <= 0).any() or (m.tokens <= 0).any():
        raise ValueError("batch sizes, token counts and timings must be positive")
    if kind not in ("auto", *_FITTERS):
        raise ValueError(f"cost model {kind!r} is not one of auto, {', '.join(_FITTERS)}")
    kinds = list(_FITTERS) if kind == "auto" else [kind]
    fitters = {k: _FITTERS[k] for k in kinds}
    if analytic is not None:
        fitters["flops"] = _flops_fitter(analytic)
    folds = min(folds, len(m))
    candidates = {k: f(m) for k, f in fitters.items()}
    quality = {k: _quality(fitters[k], candidates[k], m, folds, seed) for k in fitters}
    chosen = min(kinds, key=lambda k: quality[k].heldout_rmse_rel)
    return CostFit(model=candidates[chosen], quality=quality, candidates=candidates)


def fit_cost_model(
    batch: np.ndarray, tokens: np.ndarray, seconds: np.ndarray, kind: str = "auto", folds: int = 5, seed: int = 0
) -> CostFit:
    """``fit_timings`` of (B, S, t) points: B samples of S tokens took t seconds."""
    return fit_timings(Timings.of_micro_batches(batch, tokens, seconds), kind=kind, folds=folds, seed=seed)
