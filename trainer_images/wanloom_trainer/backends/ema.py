"""The EMA schedule both backends apply after each optimizer step (``spec.optimizer.ema``).

After step ``s`` (0-based) every expert's average becomes ``ema + (1 - d)·(weights - ema)`` with
``d = ema_decay(spec, s)``: 0 before ``startStep`` (the average is the weights), ``decay`` from it on. An expert
that took no step (per-batch routing) still decays towards its unchanged weights, as in diffusers' EMAModel.
The average is kept in float32 whatever the master dtype: with bfloat16 masters a 0.999 decay would round most
updates away.
"""

from __future__ import annotations

from wanloom_api.trainingjob import EmaSpec


def ema_decay(spec: EmaSpec, step: int) -> float:
    """The decay applied after optimizer step ``step`` (0-based)."""
    return 0.0 if step < spec.start_step else spec.decay
