"""The variant facts the API keeps (names, expert boundary, timestep recipe, image-to-video mode) agree with the
trainer's architecture table and its synthetic data mixtures."""

from __future__ import annotations

import typing

from wanloom_api.trainingjob import (
    DEFAULT_BOUNDARY_RATIO,
    DEFAULT_IMAGE_TO_VIDEO_FRACTION,
    DEFAULT_TIMESTEPS,
    Variant,
)
from wanloom_trainer.config.variants import VARIANTS
from wanloom_trainer.data.synth import DEFAULT_MIXTURES


def test_every_table_covers_exactly_the_api_variants() -> None:
    names = set(typing.get_args(Variant))
    for table in (
        VARIANTS,
        DEFAULT_BOUNDARY_RATIO,
        DEFAULT_TIMESTEPS,
        DEFAULT_IMAGE_TO_VIDEO_FRACTION,
        DEFAULT_MIXTURES,
    ):
        assert set(table) == names


def test_api_defaults_follow_the_architecture() -> None:
    for name, variant in VARIANTS.items():
        assert (DEFAULT_BOUNDARY_RATIO[name] is not None) == variant.two_experts, name
        assert (DEFAULT_IMAGE_TO_VIDEO_FRACTION[name] is not None) == variant.per_token_timesteps, name
        assert variant.in_channels == variant.out_channels + variant.condition_channels, name
