import numpy as np
import pytest

from wanloom_trainer.adaptiveload.sizing.buckets import (
    BucketTable,
    cut_to_token_multiple,
    derive_buckets,
    require_token_multiple,
)
from wanloom_trainer.config.variants import get_variant

A14B = get_variant("wan2.2-t2v-a14b")
TABLE = BucketTable.from_pixels(
    A14B,
    [(81, 720, 1280), (81, 480, 832), (81, 832, 480), (33, 480, 832), (1, 720, 1280), (1, 480, 832), (1, 624, 624)],
)


def shape(px):
    return tuple(int(x) for x in A14B.latent_shape(*px))


@pytest.mark.parametrize(
    ("sample_px", "bucket_px"),
    [
        ((81, 720, 1280), (81, 720, 1280)),  # exact
        ((121, 1080, 1920), (81, 720, 1280)),  # longer and larger: shortened and downscaled
        ((57, 720, 1280), (33, 480, 832)),  # fewest frames that fit, then aspect, then area
        ((81, 1280, 720), (81, 832, 480)),  # portrait goes to the portrait bucket
        ((1, 1024, 1024), (1, 624, 624)),  # square image
        ((81, 240, 416), (81, 480, 832)),  # nothing small enough: the smallest of that aspect (upscale)
    ],
    ids=["exact", "down", "frames", "portrait", "square", "upscale"],
)
def test_assign_rule(sample_px, bucket_px):
    b = TABLE.assign(np.array([shape(sample_px)]))[0]
    assert tuple(TABLE.latent_shapes[b]) == shape(bucket_px)


def test_assign_needs_a_bucket_with_few_enough_frames():
    table = BucketTable.from_pixels(A14B, [(81, 720, 1280)])
    with pytest.raises(ValueError, match="fewer frames than every bucket"):
        table.assign(np.array([shape((1, 720, 1280))]))


def test_table_sorted_by_tokens_and_deduplicated():
    table = BucketTable(np.array([[21, 90, 160], [1, 90, 160], [21, 90, 160]]))
    assert table.latent_shapes.tolist() == [[1, 90, 160], [21, 90, 160]]
    np.testing.assert_array_equal(table.tokens(A14B), [3_600, 75_600])


def test_derive_keeps_all_shapes_under_the_limit():
    shapes = np.array([[21, 90, 160]] * 5 + [[1, 90, 160]] * 3)
    assert derive_buckets(shapes, max_buckets=4).latent_shapes.tolist() == [[1, 90, 160], [21, 90, 160]]


def test_derive_merges_rarest_into_a_smaller_bucket():
    common = [[21, 60, 104]] * 10 + [[1, 60, 104]] * 10
    rare = [[21, 62, 104]]  # slightly larger than a common shape: can be cut down to it
    table = derive_buckets(np.array(common + rare), max_buckets=2)
    assert table.latent_shapes.tolist() == [[1, 60, 104], [21, 60, 104]]
    assert tuple(table.latent_shapes[table.assign(np.array(rare))[0]]) == (21, 60, 104)


def test_derive_never_upscales_or_adds_frames():
    shapes = np.array([[21, 90, 160]] * 10 + [[1, 30, 52]])  # the image fits nothing smaller
    assert len(derive_buckets(shapes, max_buckets=1)) == 2


def test_derive_rejects_bad_limit():
    with pytest.raises(ValueError, match="max_buckets"):
        derive_buckets(np.array([[1, 2, 2]]), max_buckets=0)


def test_cut_to_token_multiple_keeps_the_largest_divisible_crop():
    ti2v = get_variant("wan2.2-ti2v-5b")
    table = BucketTable.from_pixels(ti2v, [(1, 480, 832), (121, 704, 1280)])  # 390 and 31 x 880 tokens
    cut = cut_to_token_multiple(table, ti2v, 4)
    assert (cut.tokens(ti2v) % 4 == 0).all()
    # 1x480x832 (latent 1x30x52) becomes 1x28x52 (14 x 26 = 364 tokens); the clip is already divisible.
    assert sorted(map(tuple, cut.latent_shapes.tolist())) == [(1, 28, 52), (31, 44, 80)]
    assert cut_to_token_multiple(table, ti2v, 1) is table


def test_require_token_multiple_names_the_field():
    with pytest.raises(ValueError, match=r"spec\.adaptiveLoad\.buckets: the latent bucket \(1, 30, 52\) is 390"):
        require_token_multiple(BucketTable.from_pixels(get_variant("wan2.2-ti2v-5b"), [(1, 480, 832)]),
                               get_variant("wan2.2-ti2v-5b"), 4)  # fmt: skip
