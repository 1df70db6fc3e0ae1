import numpy as np
import pytest

from wanloom_trainer.adaptiveload.comparison.simulate import MixSpec, synthetic_index
from wanloom_trainer.config.variants import get_variant

from .conftest import A14B


def test_synthetic_mix_follows_its_parameters():
    mix = MixSpec()
    px = mix.pixel_shapes(20_000, seed=1)
    images = px[:, 0] == 1
    assert images.mean() == pytest.approx(mix.image_share, abs=0.01)
    clip_frames = px[~images, 0]
    assert set(np.unique(clip_frames)) <= set(mix.frame_buckets)
    assert (clip_frames == 81).mean() == pytest.approx(0.70, abs=0.03)  # 5 s window vs 8.5 s mean clips
    hi = np.maximum(px[~images, 1], px[~images, 2]) >= 960
    assert hi.mean() == pytest.approx(mix.clip_720p_share, abs=0.02)


def test_index_is_valid_for_the_variant_and_scaled_mix():
    tiny = get_variant("tiny")
    index = synthetic_index(tiny, 500, seed=0, mix=MixSpec(scale=4))
    tokens = [tiny.tokens(*s) for s in index.latent_shapes]
    assert 21 * 11 * 20 in tokens  # 720p landscape clips at 1/4 size: 176x320 pixels
    assert max(tokens) == 21 * 15 * 15  # square 960/4 = 240 pixels
    full = synthetic_index(A14B, 500, seed=0)
    assert max(A14B.tokens(*s) for s in full.latent_shapes) == 75_600
