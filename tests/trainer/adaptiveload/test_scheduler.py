import numpy as np
import pytest

from wanloom_trainer.adaptiveload.assignment.scheduler import BucketChunks, SampleStream


def test_stream_covers_every_sample_once_per_epoch():
    stream = SampleStream(10, seed=3)
    epoch0 = np.concatenate([stream.step(s, 5) for s in range(2)])
    epoch1 = np.concatenate([stream.step(s, 5) for s in range(2, 4)])
    assert sorted(epoch0) == list(range(10)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)  # reshuffled each epoch


def test_stream_step_spans_epoch_boundary():
    stream = SampleStream(10, seed=0)
    np.testing.assert_array_equal(stream.step(1, 7), np.concatenate([stream.epoch(0)[7:], stream.epoch(1)[:4]]))


def test_stream_is_a_function_of_seed_and_step():
    fresh = SampleStream(1000, seed=5).step(123, 64)
    used = SampleStream(1000, seed=5)
    for s in range(10):
        used.step(s, 64)
    np.testing.assert_array_equal(used.step(123, 64), fresh)
    assert not np.array_equal(SampleStream(1000, seed=6).step(123, 64), fresh)


def test_chunks_are_single_bucket_and_cover_the_epoch():
    bucket_of = np.array([0] * 7 + [1] * 5 + [2] * 1)
    chunks = BucketChunks(bucket_of, np.array([3, 2, 4]), seed=1)
    assert chunks.per_epoch == 3 + 3 + 1
    seen = []
    for j in range(chunks.per_epoch):
        b, pos = chunks.chunk(j)
        assert set(bucket_of[pos]) == {b}
        assert len(pos) <= [3, 2, 4][b]
        seen.extend(pos.tolist())
    assert sorted(seen) == list(range(13))


def test_chunks_resume_without_history():
    bucket_of = np.random.default_rng(0).integers(0, 4, 500)
    a = BucketChunks(bucket_of, np.array([5, 3, 2, 1]), seed=9)
    b = BucketChunks(bucket_of, np.array([5, 3, 2, 1]), seed=9)
    for j in range(50):
        a.chunk(j)
    for j in (1_000, 1, 2_345):
        assert a.chunk(j)[0] == b.chunk(j)[0]
        np.testing.assert_array_equal(a.chunk(j)[1], b.chunk(j)[1])


def test_bad_inputs():
    with pytest.raises(ValueError, match="no samples"):
        SampleStream(0, 0)
    with pytest.raises(ValueError, match="chunk sizes"):
        BucketChunks(np.zeros(3, dtype=int), np.array([0]), 0)
