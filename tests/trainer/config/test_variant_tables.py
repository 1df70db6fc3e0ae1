"""The variant facts the API keeps (names, expert boundary, timestep recipe, image-to-video mode) agree with the
trainer's architecture table and its synthetic data mixtures."""

from __future__ import annotations

import typing

from wanloom_api.trainingjob import (
    DEFAULT_BOUNDARY_RATIO,
    DEFAULT_IMAGE_TO_VIDEO_FRACTION,
    DEFAULT_TIMESTEPS,
    SEQUENCE_GEOMETRY,
    Variant,
    tokens_per_sample,
)
from wanloom_trainer.config.variants import VARIANTS
from wanloom_trainer.data.synthetic import DEFAULT_MIXTURES


def test_every_table_covers_exactly_the_api_variants() -> None:
    names = set(typing.get_args(Variant))
    for table in (
        VARIANTS,
        DEFAULT_BOUNDARY_RATIO,
        DEFAULT_TIMESTEPS,
        DEFAULT_IMAGE_TO_VIDEO_FRACTION,
        DEFAULT_MIXTURES,
        SEQUENCE_GEOMETRY,
    ):
        assert set(table) == names


def test_api_defaults_follow_the_architecture() -> None:
    for name, variant in VARIANTS.items():
        assert (DEFAULT_BOUNDARY_RATIO[name] is not None) == variant.two_experts, name
        assert (DEFAULT_IMAGE_TO_VIDEO_FRACTION[name] is not None) == variant.per_token_timesteps, name
        assert variant.in_channels == variant.out_channels + variant.condition_channels, name


def test_the_api_sequence_geometry_is_the_architecture() -> None:
    for name, variant in VARIANTS.items():
        heads, pixels_per_token = SEQUENCE_GEOMETRY[name]
        assert heads == variant.num_heads, name
        assert pixels_per_token == (
            variant.vae_stride[0] * variant.patch_size[0],
            variant.vae_stride[1] * variant.patch_size[1],
            variant.vae_stride[2] * variant.patch_size[2],
        ), name
        for frames, height, width in ((1, 480, 832), (81, 720, 1280), (121, 704, 1280)):
            assert tokens_per_sample(name, frames, height, width) == variant.tokens_for_pixels(frames, height, width)
