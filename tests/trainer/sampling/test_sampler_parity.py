"""Validation videos preview what inference gives: the sampler run through each trainer's ``predict`` (the path
validation takes) against diffusers' ``WanPipeline`` with ``UniPCMultistepScheduler`` configured as the Wan
pipelines configure it, on the same weights, noise, prompt embeddings and guidance pair: the final latents agree
within 1e-5 relative and the expert switches at the same step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel  # noqa: E402

from wanloom_api.validation import parse_trainingjob  # noqa: E402
from wanloom_trainer.config.train_config import from_trainingjob  # noqa: E402
from wanloom_trainer.config.variants import get_variant  # noqa: E402
from wanloom_trainer.model.wan_torch import build_expert  # noqa: E402
from wanloom_trainer.sampling.sampler import SamplerConfig, sample, unipc_grid  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = get_variant("tiny")
BOUNDARY, SHIFT, GUIDANCE = 0.875, 5.0, (4.0, 3.0)
LATENT = (1, 4, 3, 8, 8)  # 9 frames of 64 x 64 pixels


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sampler-parity")
    for expert, folder in enumerate(("transformer", "transformer_2")):
        build_expert(TINY, seed=40 + expert).save_pretrained(root / "base" / folder)
    return root


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    noise = rng.standard_normal(LATENT).astype(np.float32)
    text = rng.standard_normal((1, TINY.text_len, TINY.text_dim)).astype(np.float32)
    negative = rng.standard_normal((TINY.text_len, TINY.text_dim)).astype(np.float32)
    return noise, text, negative


def _pipeline(base: Path, steps: int, guidance: tuple[float, float]) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """WanPipeline's latents and the (expert, timestep) of each model call."""
    experts = [WanTransformer3DModel.from_pretrained(base / "base" / f) for f in ("transformer", "transformer_2")]
    calls: list[tuple[int, float]] = []
    for e, model in enumerate(experts):
        model.register_forward_pre_hook(
            lambda _m, _a, kw, e=e: calls.append((e, float(kw["timestep"][0]))), with_kwargs=True
        )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=SHIFT
    )
    pipe = WanPipeline(None, None, None, scheduler, experts[0], experts[1], boundary_ratio=BOUNDARY)
    noise, text, negative = _inputs()
    with torch.no_grad():
        out = pipe(
            prompt_embeds=torch.from_numpy(text), negative_prompt_embeds=torch.from_numpy(negative[None]),
            latents=torch.from_numpy(noise), num_inference_steps=steps, guidance_scale=guidance[0],
            guidance_scale_2=guidance[1], height=64, width=64, num_frames=9, output_type="latent",
        ).frames  # fmt: skip
    return out.numpy(), calls


def _ours(base: Path, backend_name: str, steps: int, guidance: tuple[float, float], tmp: Path) -> tuple[Any, list]:
    from wanloom_trainer.train.run import make_backend

    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["spec"]["model"]["weights"] = str(base / "base")
    doc["spec"]["resources"]["backend"] = backend_name
    doc["spec"]["data"]["uri"] = str(tmp / "data")
    doc["spec"]["training"]["checkpoint"] = {"uri": str(tmp / "ckpt")}
    config = from_trainingjob(parse_trainingjob(doc), {"WANLOOM_RUN_DIR": str(tmp / "run")})
    backend = make_backend(config)
    calls: list[tuple[int, float]] = []
    try:
        state = backend.init_state()

        def predict(expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
            calls.append((expert, float(t[0])))
            return backend.predict(state, expert, x, t, text)

        noise, text, negative = _inputs()
        config = SamplerConfig(steps, SHIFT, BOUNDARY, guidance, solver="unipc")
        return sample(predict, noise, text, negative, config), calls
    finally:
        backend.close()


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_unipc_validation_latents_are_wan_pipelines(base: Path, backend: str, tmp_path: Path) -> None:
    steps = 10
    want, their_calls = _pipeline(base, steps, GUIDANCE)
    got, our_calls = _ours(base, backend, steps, GUIDANCE, tmp_path)
    error = _relative(got, want)
    print(f"{backend}: UniPC {steps} steps, final latents {error:.2e} relative to WanPipeline")
    assert error <= 1e-5
    # One batched call (both prompts) per step here, two in the pipeline: the same expert at the same timestep.
    assert our_calls == their_calls[::2] == their_calls[1::2]
    switch = [e for e, _ in our_calls].index(1)
    assert 0 < switch < steps and our_calls[switch - 1][1] >= 1000 * BOUNDARY > our_calls[switch][1]


@pytest.mark.slow
def test_guidance_one_runs_the_conditional_prompt_alone(base: Path, tmp_path: Path) -> None:
    steps = 6
    want, their_calls = _pipeline(base, steps, (1.0, 1.0))  # the pipeline skips the unconditional call too
    got, our_calls = _ours(base, "torch", steps, (1.0, 1.0), tmp_path)
    assert _relative(got, want) <= 1e-5
    assert our_calls == their_calls and len(our_calls) == steps


def test_the_grid_is_the_schedulers() -> None:
    for steps, shift in ((10, 5.0), (40, 12.0), (50, 5.0), (3, 1.0)):
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=shift
        )
        scheduler.set_timesteps(steps)
        sigma, timesteps = unipc_grid(steps, shift)
        np.testing.assert_array_equal(sigma, scheduler.sigmas.numpy())
        np.testing.assert_array_equal(timesteps, scheduler.timesteps.numpy())
