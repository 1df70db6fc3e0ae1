import numpy as np
import pytest

from wanloom_trainer.adaptiveload.sizing.batch_size import (
    default_compute_budget,
    equal_token_batch_sizes,
    paper_batch_sizes,
)

TOKENS = np.array([1_560, 3_600, 32_760, 75_600])


def test_equal_tokens_is_memory_over_tokens():
    np.testing.assert_array_equal(equal_token_batch_sizes(TOKENS, 151_200), [96, 42, 4, 2])


@pytest.mark.parametrize(
    ("m_comp", "p", "expected"),
    [
        (75_600.0**2, 2.0, [96, 42, 4, 1]),  # compute binds only for the longest bucket
        (2 * 75_600.0**2, 2.0, [96, 42, 4, 2]),  # loose: same as equal tokens
        (1.0, 2.0, [1, 1, 1, 1]),  # tight: the B = 1 clamp
        (32_760.0**1.5 * 3, 1.5, [96, 42, 3, 1]),  # an exact multiple is not lost to rounding
    ],
    ids=["binds-long", "loose", "clamp", "exact-multiple"],
)
def test_paper_rule(m_comp, p, expected):
    np.testing.assert_array_equal(paper_batch_sizes(TOKENS, 151_200, m_comp, p), expected)


def test_paper_never_exceeds_memory():
    b = paper_batch_sizes(TOKENS, 151_200, 1e30, 1.0)
    assert np.all(b * TOKENS <= 151_200)


def test_memory_budget_below_longest_sample_is_an_error():
    with pytest.raises(ValueError, match="memoryBudgetTokens=50000 is smaller than the longest sample"):
        equal_token_batch_sizes(TOKENS, 50_000)


def test_default_compute_budget_is_weighted_median_of_memory_full_batches():
    tokens = np.array([100, 200, 400])
    # memory-full batches: 20 x 100^2 = 2e5, 10 x 200^2 = 4e5, 5 x 400^2 = 8e5; one longest sample: 1.6e5
    assert default_compute_budget(tokens, 2.0, 2_000, np.array([9, 1, 1])) == pytest.approx(2e5)
    assert default_compute_budget(tokens, 2.0, 2_000, np.array([1, 9, 1])) == pytest.approx(4e5)
    assert default_compute_budget(tokens, 2.0, 2_000, np.array([1, 1, 9])) == pytest.approx(8e5)


def test_default_compute_budget_never_below_one_longest_sample():
    # memory-full: 10 x 100^2 = 1e5 (most samples) but one 400-token sample computes 1.6e5
    assert default_compute_budget(np.array([100, 400]), 2.0, 1_000, np.array([9, 1])) == pytest.approx(1.6e5)
