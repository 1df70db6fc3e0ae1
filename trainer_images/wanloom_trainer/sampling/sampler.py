"""Flow-matching sampling with both experts: UniPC (as Wan 2.2's release and diffusers' Wan pipelines sample) or
Euler, the expert switched at the routing boundary, classifier-free guidance per expert.

The model predicts the velocity v = ε − x0 of x_σ = (1 − σ)·x0 + σ·ε (``backends.objective``); the model sees
t = 1000·σ, and t ≥ 1000·boundary goes to the high-noise expert (0), lower t to the low-noise one (1). Guidance
mixes the two halves of one batch: v = v_neg + g_expert·(v_cond − v_neg), the negative half on the negative
prompt's embedding (the empty prompt by default, as in the pipelines); an expert whose guidance is 1 runs the
conditional half alone.

Solvers (``SamplerConfig.solver``):

- ``unipc``: diffusers' ``UniPCMultistepScheduler`` as ``WanPipeline`` configures it (flow prediction, order 2,
  B(h) = e^h − 1 ("bh2"), data prediction, first-order last step, final σ 0): σ runs over ``steps`` values from
  1 − 1/1000 (nudged below 1, where log σ would diverge) down to 1/1000·shifted, each shifted as in training
  (σ' = sσ / (1 + (s − 1)σ)), and the model sees the **whole-number** timesteps ⌊1000·σ⌋ the pipeline passes. Each
  step converts v to x0 = x − σ·v, corrects the previous step with it (UniC) and predicts the next (UniP), in
  λ = log((1 − σ)/σ). Scalars in float32 as the scheduler computes them.
- ``euler``: σ from 1 to 0 in ``steps`` equal parts of the unshifted schedule, shifted; x ← x + (σ' − σ)·v, the
  model at t = 1000·σ (fractional).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# (expert, x_t with any condition channels [B, C, T', H', W'], t [B], text [B, L, D]) -> velocity [B, C_out, ...]
Predict = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
SOLVERS = ("unipc", "euler")
NUM_TRAIN_TIMESTEPS = 1000
_F32 = np.float32


@dataclass(frozen=True)
class SamplerConfig:
    """steps: solver steps (model calls per video, doubled by guidance); shift: the sigma shift; boundary_ratio: None
    for a single model; guidance: scale per expert (high-noise, low-noise); solver: "unipc" or "euler"."""

    steps: int
    shift: float
    boundary_ratio: float | None
    guidance: tuple[float, float]
    solver: str = "unipc"

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise ValueError(f"spec.validation.sampler {self.solver!r} is not one of {', '.join(SOLVERS)}")


def sigmas(steps: int, shift: float) -> np.ndarray:
    """The Euler grid, float64 [steps + 1]: 1 → 0, shifted."""
    base = np.linspace(1.0, 0.0, steps + 1)
    return _shifted(base, shift)


def unipc_grid(steps: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """UniPC's (sigmas float32 [steps + 1] ending in 0, timesteps int64 [steps]) as the scheduler sets them."""
    base = np.linspace(1.0, 1.0 / NUM_TRAIN_TIMESTEPS, steps + 1)[:-1]
    shifted = _shifted(base, shift)
    if abs(shifted[0] - 1.0) < 1e-6:
        shifted[0] -= 1e-6
    timesteps = (shifted * NUM_TRAIN_TIMESTEPS).astype(np.int64)  # truncated, as the pipeline passes them
    return np.concatenate([shifted, [0.0]]).astype(_F32), timesteps


def _shifted(sigma: np.ndarray, shift: float) -> np.ndarray:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def expert_at(t: float, boundary_ratio: float | None) -> int:
    return 0 if boundary_ratio is None or t >= NUM_TRAIN_TIMESTEPS * boundary_ratio else 1


def sample(
    predict: Predict,
    noise: np.ndarray,
    text: np.ndarray,
    negative_text: np.ndarray,
    config: SamplerConfig,
    condition: np.ndarray | None = None,
) -> np.ndarray:
    """Latents x0 [B, C, T', H', W'] from ``noise`` (x at σ = 1) for ``text`` [B, L, D] (``negative_text`` [L, D] the
    negative prompt of guidance); ``condition`` [B, Cc, ...] rides along on the channel axis (I2V)."""
    guided = _Guided(predict, text, negative_text, config, condition)
    x = noise.astype(_F32)
    if config.solver == "euler":
        s = sigmas(config.steps, config.shift)
        for i in range(config.steps):
            v = guided(x, float(_F32(NUM_TRAIN_TIMESTEPS * s[i])))
            x = (x + (s[i + 1] - s[i]) * v).astype(_F32)
        return x
    grid, timesteps = unipc_grid(config.steps, config.shift)
    solver = _UniPC(grid)
    for i, t in enumerate(timesteps.tolist()):
        x = solver.step(i, guided(x, float(t)), x)
    return x


class _Guided:
    """The velocity at (x, t) with the expert of t and its guidance: one batched call on both prompts, or the
    conditional prompt alone where the guidance is 1."""

    def __init__(
        self,
        predict: Predict,
        text: np.ndarray,
        negative: np.ndarray,
        config: SamplerConfig,
        condition: np.ndarray | None,
    ) -> None:
        self.predict, self.config, self.condition = predict, config, condition
        self.text = text.astype(_F32)
        self.both = np.concatenate([text, np.broadcast_to(negative, text.shape)]).astype(_F32)

    def __call__(self, x: np.ndarray, t: float) -> np.ndarray:
        expert = expert_at(t, self.config.boundary_ratio)
        scale = self.config.guidance[expert]
        inputs = x if self.condition is None else np.concatenate([x, self.condition.astype(_F32)], axis=1)
        b = len(x)
        if scale == 1.0:
            return self.predict(expert, inputs, np.full(b, t, _F32), self.text)
        velocity = self.predict(expert, np.concatenate([inputs, inputs]), np.full(2 * b, t, _F32), self.both)
        cond, negative = velocity[:b], velocity[b:]
        return negative + _F32(scale) * (cond - negative)


class _UniPC:
    """UniPC-2 with the B(h) = e^h − 1 coefficients in data prediction over flow sigmas (module docstring); the
    history is the last two x0 predictions."""

    def __init__(self, grid: np.ndarray) -> None:
        self.sigma = grid
        with np.errstate(divide="ignore"):  # λ(0) = +inf: the last step lands on its x0 prediction
            self.lam = np.log(_F32(1) - grid) - np.log(grid)
        self.x0: list[np.ndarray] = []  # x0 predictions, oldest first (at most two)
        self.last_sample: np.ndarray | None = None
        self.order = 0  # the order the previous predictor step used

    def step(self, i: int, velocity: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x at σ_{i+1} from x at σ_i and the model's velocity there."""
        x0 = (x - self.sigma[i] * velocity).astype(_F32)
        if self.last_sample is not None:  # corrector: redo the last step with the new x0
            x = self._update(i - 1, i, self.last_sample, self.order, x0)
        self.x0 = [*self.x0[-1:], x0]
        steps = len(self.sigma) - 1
        self.order = min(2, steps - i, len(self.x0))  # first order at the start and at the last step
        self.last_sample = x
        return self._update(i, i + 1, x, self.order, None)

    def _update(self, s: int, t: int, x: np.ndarray, order: int, x0_t: np.ndarray | None) -> np.ndarray:
        """From x at σ_s to σ_t with the history's x0 (UniP when ``x0_t`` is None, else UniC with x0 at σ_t)."""
        sigma_t, sigma_s, lam_t, lam_s = self.sigma[t], self.sigma[s], self.lam[t], self.lam[s]
        m0 = self.x0[-1]
        h = lam_t - lam_s
        hh = -h
        h_phi_1 = np.expm1(hh)
        b_h = np.expm1(hh)
        alpha_t = _F32(1) - sigma_t
        base = (sigma_t / sigma_s * x - alpha_t * h_phi_1 * m0).astype(_F32)
        d1 = None
        if order == 2:
            rk = (self.lam[s - 1] - lam_s) / h
            d1 = (self.x0[-2] - m0) / rk
        if x0_t is None:  # UniP: rho = 1/2 for order 2
            return base if d1 is None else (base - alpha_t * b_h * (_F32(0.5) * d1)).astype(_F32)
        d1_t = x0_t - m0
        if d1 is None:  # UniC of order 1: rho = 1/2
            return (base - alpha_t * b_h * (_F32(0.5) * d1_t)).astype(_F32)
        rho = _corrector_weights(float(rk), float(hh), float(b_h))
        return (base - alpha_t * b_h * (rho[0] * d1 + rho[1] * d1_t)).astype(_F32)


def _corrector_weights(rk: float, hh: float, b_h: float) -> np.ndarray:
    """UniC-2's ρ: R ρ = b with R = [[1, 1], [r_k, 1]] and b_i = i!·φ_{i+1}(hh)·hh/B(h) (the scheduler's recursion)."""
    h_phi = np.expm1(hh) / hh - 1.0
    b = [h_phi / b_h]
    h_phi = h_phi / hh - 0.5
    b.append(h_phi * 2.0 / b_h)
    return np.linalg.solve(np.array([[1.0, 1.0], [rk, 1.0]]), np.array(b)).astype(_F32)
