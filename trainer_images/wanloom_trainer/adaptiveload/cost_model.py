"""Step-time models of one micro-batch of B samples with S tokens each, and their fit to measured timings.

- ``PowerCost``: the AdaptiveLoad paper's ``t = a + b·B·S^p`` (arXiv 2605.17923, §cost fitting).
- ``TwoTermCost``: ``t = a + B·(α·S + β·S²)``, the linear layers plus attention; one exponent cannot follow the
  drift from ~1 (images) to ~2 (long clips), two terms can.
- ``FlopCost``: the analytic Wan FLOP count (``wanloom_trainer.flops``) at an assumed sustained FLOP rate; used when
  no shape benchmark exists.

``a`` is a fixed overhead paid once per micro-batch (a forward/backward call: launches, FSDP all-gathers);
``sample_cost(S)`` is the marginal cost of one sample. ``fit_cost_model`` fits both families by non-linear least
squares on relative residuals (timings span orders of magnitude) and picks the one with the lower k-fold held-out
error.
"""

from __future__ import annotations

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


def _token_scale(s: np.ndarray) -> float:
    """Geometric mean of the token counts: fitting in these units keeps S and S² near 1 whatever the model size."""
    return float(np.exp(np.mean(np.log(s))))


def _fit_power(b: np.ndarray, s: np.ndarray, t: np.ndarray) -> PowerCost:
    scale = _token_scale(s)
    x = s / scale

    def residual(theta: np.ndarray) -> np.ndarray:
        a, log_b, p = theta
        return (a + np.exp(log_b) * b * x**p - t) / t

    starts = [_power_start(b, x, t, p) for p in (1.0, 1.5, 2.0)]
    bounds = ([0.0, -_LOG_B_BOUND, _P_BOUNDS[0]], [np.inf, _LOG_B_BOUND, _P_BOUNDS[1]])
    best = min((optimize.least_squares(residual, x0, bounds=bounds) for x0 in starts), key=lambda r: r.cost)
    a, log_b, p = best.x
    return PowerCost(a=float(a), b=float(np.exp(log_b) / scale**p), p=float(p))


def _power_start(b: np.ndarray, x: np.ndarray, t: np.ndarray, p: float) -> np.ndarray:
    """Linear least squares for (a, b) at a fixed p: a starting point for the non-linear fit."""
    design = np.stack([np.ones_like(t), b * x**p], axis=1) / t[:, None]
    (a, coef), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    log_b = np.clip(np.log(max(coef, 1e-300)), -_LOG_B_BOUND + 1, _LOG_B_BOUND - 1)
    return np.array([max(a, 0.0), log_b, p])


def _fit_two_term(b: np.ndarray, s: np.ndarray, t: np.ndarray) -> TwoTermCost:
    scale = _token_scale(s)
    x = s / scale
    design = np.stack([np.ones_like(t), b * x, b * x * x], axis=1)

    def residual(theta: np.ndarray) -> np.ndarray:
        return (design @ theta - t) / t

    x0, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    fit = optimize.least_squares(residual, np.maximum(x0, 0.0), bounds=(0.0, np.inf))
    a, alpha, beta = fit.x
    return TwoTermCost(a=float(a), alpha=float(alpha / scale), beta=float(beta / scale**2))


_FITTERS = {"power": _fit_power, "two-term": _fit_two_term}


def _quality(
    kind: str, model: CostModel, b: np.ndarray, s: np.ndarray, t: np.ndarray, folds: int, seed: int
) -> FitQuality:
    pred = predict(model, b, s)
    order = np.random.default_rng(seed).permutation(len(t))
    held = np.empty_like(t)
    for fold in np.array_split(order, folds):
        train = np.setdiff1d(order, fold)
        held[fold] = predict(_FITTERS[kind](b[train], s[train], t[train]), b[fold], s[fold])
    r2 = 1.0 - np.sum((pred - t) ** 2) / np.sum((t - t.mean()) ** 2)
    rel = lambda p: float(np.sqrt(np.mean(((p - t) / t) ** 2)))
    return FitQuality(rmse_rel=rel(pred), heldout_rmse_rel=rel(held), r2=float(r2))


def fit_cost_model(
    batch: np.ndarray, tokens: np.ndarray, seconds: np.ndarray, kind: str = "auto", folds: int = 5, seed: int = 0
) -> CostFit:
    """Fit step-time models to measured (B, S, t) points.

    Args:
        batch, tokens, seconds: [n] each; n ≥ 6 and at least 3 distinct S so both families are identifiable.
        kind: "power", "two-term" or "auto" (both fitted, the lower held-out error chosen).
        folds: k of the k-fold held-out error (capped at n).

    Returns:
        The chosen model, both candidates and their fit quality.
    """
    b, s, t = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (batch, tokens, seconds))
    if not len(b) == len(s) == len(t):
        raise ValueError(f"batch, tokens and seconds differ in length: {len(b)}, {len(s)}, {len(t)}")
    if len(t) < 6 or len(np.unique(s)) < 3:
        raise ValueError(f"need >= 6 timings over >= 3 sequence lengths to fit, got {len(t)} over {len(np.unique(s))}")
    if (t <= 0).any() or (b <= 0).any() or (s <= 0).any():
        raise ValueError("batch sizes, token counts and timings must be positive")
    if kind not in ("auto", *_FITTERS):
        raise ValueError(f"cost model {kind!r} is not one of auto, {', '.join(_FITTERS)}")
    kinds = list(_FITTERS) if kind == "auto" else [kind]
    folds = min(folds, len(t))
    candidates = {k: _FITTERS[k](b, s, t) for k in kinds}
    quality = {k: _quality(k, candidates[k], b, s, t, folds, seed) for k in kinds}
    chosen = min(kinds, key=lambda k: quality[k].heldout_rmse_rel)
    return CostFit(model=candidates[chosen], quality=quality, candidates=candidates)
