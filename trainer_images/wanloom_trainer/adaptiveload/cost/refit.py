"""The cost model refitted online from the trainer's own measured slot times.

Each step the trainer times every micro-batch slot on its process (forward and backward, the device synchronised,
before the gradient update) and pairs the time with the work the plan predicted to bound that slot: the samples of
its heaviest (rank, slot) cell (``LocalPlan.slot_work``). In both trainer modes every rank waits for that cell —
FSDP's collectives in every micro-batch (lockstep), one program over all rows (SPMD) — so the slot's time is that
cell's time plus waiting that the fit treats as noise.

``OnlineRefit`` keeps the latest ``window`` measurements (timings that are not finite and positive are dropped and
counted) and fits the job's model family (``fit_timings``) beside the analytic FLOP model with its overhead and rate
fitted to the same data. A refit can only replace the model in use by a model that passes every check:

- the family's fit, when its k-fold held-out error beats the analytic model's (a family that cannot beat FLOP
  counting on the run's own timings is not worth trusting) and the model in use's, both by ``MARGIN``;
- else the analytic model refitted, when it beats the model in use by ``MARGIN``;
- and either only when it is not degenerate (``degenerate``): finite positive costs, the per-sample part explaining
  at least ``MIN_MARGINAL_SHARE`` of the measured time and an overhead below the median slot time, so that constant
  or pure-noise timings cannot install a model that ranks every shape alike (on a tiny CPU model the per-sample part
  is a few per cent of a slot: it still ranks shapes).

Anything else keeps the model in use ("rejected" with a warning, or "kept").

Planning only needs cost *ratios*, so the error of the model in use is measured after one best scale factor: a
model in S^p units (an exponent from the spec) is judged like one in seconds.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wanloom_trainer.adaptiveload.cost.cost_model import (
    CostModel,
    FlopCost,
    PowerCost,
    Timings,
    TwoTermCost,
    fit_timings,
    relative_rmse,
)

MIN_MEASUREMENTS = 12
# A fit must beat its yardstick by 2% (relative) to change plans: near-ties on noisy timings would only churn them.
MARGIN = 0.98
# The per-sample costs must explain at least this share of the measured slot times: below it a model is all
# overhead (a fit to constant or pure-noise timings) and would plan every shape alike.
MIN_MARGINAL_SHARE = 0.01


@dataclass(frozen=True)
class RefitOutcome:
    """One refit.

    Attributes:
        model: the model to plan with from now on (the family's fit, or the analytic FLOP model refitted), checked
            as the module docstring says; None: keep the model in use.
        measurements: how many slot timings it saw.
        heldout_error: k-fold held-out relative RMS error of the fit (None without a fit).
        analytic_heldout_error: the same for the analytic FLOP model with fitted overhead and rate.
        in_use_error: relative RMS error of the model in use on the same timings, after one best scale factor.
        verdict: "accepted", "rejected" (no candidate passed its checks), "kept" (no better than the model in
            use), or None (too few measurements to fit).
        message: one line for the log.
    """

    model: CostModel | None
    measurements: int
    heldout_error: float | None
    analytic_heldout_error: float | None
    in_use_error: float | None
    verdict: str | None
    message: str


def degenerate(model: CostModel, timings: Timings) -> str | None:
    """Why ``model`` cannot plan from these timings (module docstring), or None."""
    params = [v for v in model.to_dict().values() if isinstance(v, int | float)]
    costs = np.asarray(model.sample_cost(np.unique(timings.tokens)), dtype=np.float64)
    if not all(np.isfinite(params)) or not np.isfinite(costs).all() or (costs <= 0).any():
        return "it predicts non-finite or non-positive costs"
    share = float(np.mean(timings.totals(model.sample_cost(timings.tokens)) / timings.seconds))
    if share < MIN_MARGINAL_SHARE:
        return f"its per-sample costs explain {share:.2%} of the measured time: it ranks every shape alike"
    if model.overhead >= float(np.median(timings.seconds)):
        return f"its overhead {model.overhead:.3g} s is not below the median slot time"
    return None


def scale_free_error(model: CostModel, timings: Timings) -> float:
    """Relative RMS error of c·prediction with the c that minimises it (closed form of the relative least squares)."""
    ratio = timings.predict(model) / timings.seconds
    c = ratio.sum() / max(float((ratio * ratio).sum()), 1e-300)
    return relative_rmse(c * timings.predict(model), timings.seconds)


class OnlineRefit:
    """Slot timings of the latest steps and the refit they support (one per trainer; process 0 decides).

    Args:
        variant: the Wan variant (the analytic yardstick's FLOP count).
        kind: the family fitted: "power", "two-term" or "auto" (``spec.adaptiveLoad.costModel``).
        window: measurements kept (the oldest dropped first), so the fit follows drift such as a warming cache.
    """

    def __init__(self, variant: str, kind: str = "auto", window: int = 512) -> None:
        self.variant, self.kind = variant, kind if kind in ("power", "two-term") else "auto"
        self._work: deque[tuple[int, ...]] = deque(maxlen=window)
        self._seconds: deque[float] = deque(maxlen=window)
        self.dropped = 0  # timings that were not finite and positive

    def __len__(self) -> int:
        return len(self._seconds)

    def add(self, work: Sequence[Sequence[int]], seconds: Sequence[float]) -> None:
        """One step's slots: the token counts of each slot's bounding cell and the slot's measured seconds."""
        if len(work) != len(seconds):
            raise ValueError(f"{len(work)} slots planned but {len(seconds)} timed")
        for w, t in zip(work, seconds, strict=True):
            if not len(w):
                continue
            if not (np.isfinite(t) and t > 0):  # a stalled or broken timer: never a point to fit
                self.dropped += 1
                continue
            self._work.append(tuple(int(x) for x in w))
            self._seconds.append(float(t))

    def timings(self) -> Timings:
        return Timings.of_work(list(self._work), list(self._seconds))

    def refit(self, in_use: CostModel) -> RefitOutcome:
        """Fit the window; replace the model in use only by a candidate that passes its checks (module docstring)."""
        n = len(self)
        timings = self.timings() if n else None
        in_use_error = scale_free_error(in_use, timings) if timings is not None else None
        lengths = len(np.unique(timings.tokens)) if timings is not None else 0
        if n < MIN_MEASUREMENTS or lengths < 3:
            return RefitOutcome(
                None, n, None, None, in_use_error, None,
                f"cost refit waits for >= {MIN_MEASUREMENTS} slot timings over >= 3 sequence lengths "
                f"(has {n} over {lengths})",
            )  # fmt: skip
        fit = fit_timings(timings, kind=self.kind, analytic=self.variant)
        mine, analytic = fit.quality[fit.model.kind].heldout_rmse_rel, fit.quality["flops"].heldout_rmse_rel
        dropped = f"; {self.dropped} non-finite or non-positive timings dropped" if self.dropped else ""
        summary = (
            f"{fit.model.kind} fit of {n} slot timings: held-out error {mine:.1%} vs {analytic:.1%} for the analytic "
            f"FLOP model (model in use: {in_use_error:.1%}){dropped}"
        )
        outcome = functools.partial(RefitOutcome, measurements=n, heldout_error=mine, analytic_heldout_error=analytic,
                                    in_use_error=in_use_error)  # fmt: skip
        if mine < MARGIN * analytic:
            if mine >= MARGIN * in_use_error:
                return outcome(None, verdict="kept", message=f"cost refit kept the model in use: {summary}")
            why = degenerate(fit.model, timings)
            if why is None:
                return outcome(fit.model, verdict="accepted", message=f"cost refit accepted: {summary}")
            return outcome(None, verdict="rejected", message=f"cost refit rejected ({why}): {summary}")
        flops = fit.candidates["flops"]
        why = degenerate(flops, timings)
        if analytic < MARGIN * in_use_error and why is None:
            message = (
                f"cost refit accepted the analytic FLOP model refitted (overhead {flops.overhead * 1e3:.3g} ms, "
                f"{flops.flops_per_second / 1e9:.4g} GFLOP/s): {summary}"
            )
            return outcome(flops, verdict="accepted", message=message)
        reason = f"the refitted analytic model: {why}" if why else "no better than the analytic model"
        return outcome(None, verdict="rejected", message=f"cost refit rejected ({reason}): {summary}")


_KIND_CODES = {"power": 1.0, "two-term": 2.0, "flops": 3.0}


def encode_model(model: CostModel | None) -> list[float]:
    """A refit's model (or None) as four floats, for a broadcast from process 0."""
    if model is None:
        return [0.0, 0.0, 0.0, 0.0]
    if isinstance(model, PowerCost):
        return [_KIND_CODES["power"], model.a, model.b, model.p]
    if isinstance(model, TwoTermCost):
        return [_KIND_CODES["two-term"], model.a, model.alpha, model.beta]
    if isinstance(model, FlopCost):
        return [_KIND_CODES["flops"], model.a, model.flops_per_second, 0.0]
    raise ValueError(f"cost model kind {model.kind!r} cannot be broadcast")


def decode_model(values: Sequence[float], variant: str) -> CostModel | None:
    """``encode_model``'s inverse (``variant``: the run's, for an analytic model)."""
    code, a, x, y = (float(v) for v in values)
    if code == _KIND_CODES["power"]:
        return PowerCost(a, x, y)
    if code == _KIND_CODES["two-term"]:
        return TwoTermCost(a, x, y)
    if code == _KIND_CODES["flops"]:
        return FlopCost(variant, x, a=a)
    return None
