import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import FlopCost
from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.routing import Router, TimestepSampler

A14B = get_variant("wan2.2-t2v-a14b")
# A small mixed index (latent shapes): 720p/480p clips of two lengths and images; not the benchmark's distribution.
SHAPES = np.array([[21, 90, 160], [21, 60, 104], [9, 60, 104], [1, 90, 160], [1, 60, 104]])


@pytest.fixture
def index():
    rng = np.random.default_rng(0)
    return SampleShapes.from_arrays(
        SHAPES[rng.choice(5, 600, p=[0.15, 0.3, 0.15, 0.2, 0.2])], ids=np.arange(600) + 1000
    )


@pytest.fixture
def flop_cost():
    return FlopCost(A14B.name, 4e14, a=0.05)


@pytest.fixture
def router():
    return Router(TimestepSampler("logit-normal", shift=3.0), 0.875, "per-sample")
