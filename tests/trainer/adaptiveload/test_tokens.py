import numpy as np
import pytest

from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels, tokens_for_latents, tokens_for_pixels
from wanloom_trainer.config.variants import get_variant

A14B = get_variant("wan2.2-t2v-a14b")
TI2V = get_variant("wan2.2-ti2v-5b")


@pytest.mark.parametrize(
    ("variant", "pixels", "latent", "tokens"),
    [
        (A14B, (81, 720, 1280), (21, 90, 160), 75_600),
        (A14B, (81, 480, 832), (21, 60, 104), 32_760),
        (A14B, (1, 720, 1280), (1, 90, 160), 3_600),  # an image is a one-frame sample
        (A14B, (17, 480, 832), (5, 60, 104), 7_800),
        (TI2V, (121, 704, 1280), (31, 44, 80), 27_280),  # 16x spatial VAE stride
        (TI2V, (1, 704, 1280), (1, 44, 80), 880),
    ],
    ids=["a14b-720p81", "a14b-480p81", "a14b-image", "a14b-17f", "ti2v-704p121", "ti2v-image"],
)
def test_tokens_match_reference(variant, pixels, latent, tokens):
    assert tuple(latent_shapes_for_pixels(variant, np.array([pixels]))[0]) == latent
    assert tokens_for_pixels(variant, np.array([pixels]))[0] == tokens
    assert variant.tokens_for_pixels(*pixels) == tokens  # same as the shared variant table


def test_vectorised_over_rows():
    px = np.array([[81, 720, 1280], [1, 480, 832]])
    np.testing.assert_array_equal(tokens_for_pixels(A14B, px), [75_600, 1_560])


@pytest.mark.parametrize(
    ("pixels", "message"),
    [((80, 720, 1280), "1 \\+ a multiple"), ((81, 720, 1288), "multiple of 16"), ((0, 720, 1280), ">= 1")],
)
def test_bad_pixels_name_the_rule(pixels, message):
    with pytest.raises(ValueError, match=message):
        latent_shapes_for_pixels(A14B, np.array([pixels]))


def test_latent_not_multiple_of_patch():
    with pytest.raises(ValueError, match="patch"):
        tokens_for_latents(A14B, np.array([[21, 91, 160]]))
