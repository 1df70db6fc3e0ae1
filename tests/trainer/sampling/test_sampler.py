"""The flow-matching sampler: exact on a known velocity field, the expert switched at the boundary, guidance mixed
per expert; the media helpers write what players and viewers read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.sampling.sampler import SamplerConfig, sample, sigmas


def test_sigmas_run_from_one_to_zero_shifted_like_training() -> None:
    s = sigmas(4, 5.0)
    assert s[0] == 1.0 and s[-1] == 0.0 and np.all(np.diff(s) < 0)
    np.testing.assert_allclose(s[2], 5 * 0.5 / (1 + 4 * 0.5))


@pytest.mark.parametrize("solver", ["unipc", "euler"])
def test_exact_velocities_lead_back_to_the_clean_latents(solver: str) -> None:
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, 4, 3, 4, 4)).astype(np.float32)
    noise = rng.standard_normal(x0.shape).astype(np.float32)
    calls: list[tuple[int, float]] = []

    def predict(expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
        calls.append((expert, float(t[0])))
        return np.concatenate([noise - x0, noise - x0])  # the straight path's velocity ε − x0, the same all along

    config = SamplerConfig(steps=10, shift=3.0, boundary_ratio=0.875, guidance=(4.0, 3.0), solver=solver)
    out = sample(predict, noise, np.zeros((2, 5, 8), np.float32), np.zeros((5, 8), np.float32), config)
    np.testing.assert_allclose(out, x0, atol=1e-5)
    assert [e for e, t in calls] == [0 if t >= 875.0 else 1 for _, t in calls]
    assert {e for e, _ in calls} == {0, 1} and len(calls) == 10
    if solver == "unipc":  # the whole-number timesteps the Wan pipelines pass, from 999 down
        assert calls[0][1] == 999.0 and all(t == int(t) for _, t in calls)


@pytest.mark.parametrize(("expert_t", "scale"), [(950.0, 4.0), (500.0, 3.0)])
def test_guidance_is_per_expert(expert_t: float, scale: float) -> None:
    def predict(expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
        return text[:, :1, :1, None, None] * np.ones_like(x)  # conditional half 1, unconditional half 0

    # one step from sigma 1 (t = 1000): a boundary above or below 1000 picks the expert
    boundary = 0.875 if expert_t >= 875 else 1.5
    config = SamplerConfig(steps=1, shift=1.0, boundary_ratio=boundary, guidance=(4.0, 3.0), solver="euler")
    x = np.zeros((1, 2, 1, 2, 2), np.float32)
    out = sample(predict, x, np.ones((1, 3, 4), np.float32), np.zeros((3, 4), np.float32), config)
    np.testing.assert_allclose(out, -scale)  # x + (0 − 1)·g·(1 − 0)


def test_media_files_decode_and_read_back(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import av
    from PIL import Image

    from wanloom_trainer.sampling import media

    vae = media.small_vae(4, seed=0)
    frames = media.decode(vae, np.random.default_rng(0).standard_normal((1, 4, 3, 8, 8)).astype(np.float32))[0]
    assert frames.shape == (9, 64, 64, 3) and frames.dtype == np.uint8
    path = media.write_mp4(frames, tmp_path / "a.mp4")
    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 9 and decoded[0].shape == (64, 64, 3)
    sheet = Image.open(media.contact_sheet([frames, frames[:1]], tmp_path / "sheet.png"))
    assert sheet.size == (5 * 64, 2 * 64)


def test_saved_latents_decode_later_with_the_cli(tmp_path: Path) -> None:
    """A folder of latents alone (saved where no VAE could run) becomes clips with `wanloom decode-samples`."""
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from wanloom_cli import app
    from wanloom_trainer.sampling.media import DecodeSpec

    rng = np.random.default_rng(1)
    for sid in (3, 7):
        np.save(tmp_path / f"sample-{sid:06d}.npy", rng.standard_normal((1, 4, 3, 8, 8)).astype(np.float32))
    DecodeSpec(vae=None, latent_channels=4, seed=0).write(tmp_path)
    result = CliRunner().invoke(app, ["decode-samples", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in tmp_path.iterdir()} >= {"sample-000003.mp4", "sample-000007.mp4", "contact-sheet.png"}

    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(app, ["decode-samples", str(empty)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"wanloom decode-samples: {empty}/decode.json not found: expected a validation samples folder "
        "(samples/step-NNNNNN)"
    ]
