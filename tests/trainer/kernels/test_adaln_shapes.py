"""The packed-sequence contract: value checks on segment ids name the row and what is valid."""

from __future__ import annotations

import numpy as np
import pytest

from wanloom_trainer.kernels.adaln_shapes import adaln_layout, check_segment_ids


def test_valid_segment_ids_pass_and_set_the_segment_count() -> None:
    check_segment_ids(np.array([[0, 0, 1, 3], [0, 2, 2, 2]]), segments=4)
    assert adaln_layout((2, 4, 8), (2, 4, 8), (2, 4, 8), (2, 4)).segments == 4


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([[0, 1, 4, 4]], r"row 0 has ids outside \[0, 4\): \[4\]"),
        ([[0, 0, 0, 0], [0, -1, 1, 1]], r"row 1 has ids outside \[0, 4\)"),
        ([[0, 2, 1, 3]], "row 0 decreases along N"),
        ([0, 1, 2], r"shape \[B, N\], got \[3\]"),
    ],
)
def test_bad_segment_ids_are_named(ids: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_segment_ids(np.array(ids), segments=4)
