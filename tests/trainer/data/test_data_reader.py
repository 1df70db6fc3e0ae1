"""Random access by sample id: exact tensors, bucket fitting, and bad samples skipped, counted and bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.fit import fit_latents, resample_matrix
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.skips import TooManyBadSamples
from wanloom_trainer.data.synthetic import DEFAULT_MIXTURES, PatternBank, ShapeMix, synth_sample, write_synthetic

TINY = get_variant("tiny")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    write_synthetic(str(tmp_path / "ds"), TINY, 24, seed=3, samples_per_shard=8)
    return tmp_path / "ds"


def _expected(i: int, seed: int = 3, variant=TINY, mixture=None):  # type: ignore[no-untyped-def]
    mixture = mixture or DEFAULT_MIXTURES["tiny"]
    return synth_sample(i, seed, variant, mixture, PatternBank.create(variant, seed))


def _same_shape_ids(ds, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    shapes = ds.latent_shapes
    first = shapes[0]
    return np.flatnonzero((shapes == first).all(axis=1))[:n].tolist()


def _corrupt(root: Path, ds, sample_id: int) -> None:  # type: ignore[no-untyped-def]
    """Flip one byte inside the sample's latents payload."""
    idx = ds.index
    path = root / idx.shards[idx.shard[sample_id]]
    blob = bytearray(path.read_bytes())
    off = int(idx.span[sample_id, 0] + idx.member_ranges[sample_id, 0, 0] + idx.member_ranges[sample_id, 0, 1] - 3)
    blob[off] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_load_returns_exactly_the_written_tensors(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        assert ds.num_samples == 24 and ds.latent_shapes.shape == (24, 3)
        ids = _same_shape_ids(ds, 3)
        batch = ds.load(ids + ids[:1])  # repeats are allowed (planner padding rows)
        assert batch.latents.shape == (4, 4, *ds.latent_shapes[ids[0]])
        assert batch.text_embeds.shape == (4, TINY.text_len, TINY.text_dim) and batch.condition is None
        for row, i in enumerate([*ids, ids[0]]):
            want = _expected(i)
            np.testing.assert_array_equal(batch.latents[row], want.latents)
            n = len(want.text)
            np.testing.assert_array_equal(batch.text_embeds[row, :n], want.text)
            assert batch.text_lens[row] == n and not batch.text_embeds[row, n:].any()
        assert batch.valid.all() and batch.positions.tolist() == [0, 1, 2, 3]


def test_bad_requests_are_errors_not_skips(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=5) as ds:
        with pytest.raises(ValueError, match=r"sample id 24 is out of range; the dataset has ids 0\.\.23"):
            ds.load([0, 24])
        mixed = [int(np.flatnonzero((ds.latent_shapes != ds.latent_shapes[0]).any(axis=1))[0]), 0]
        with pytest.raises(ValueError, match="latent shapes"):
            ds.load(mixed)
        assert ds.budget.skipped == 0


def test_samples_are_fitted_to_a_smaller_bucket(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        clip = int(np.flatnonzero(ds.latent_shapes[:, 0] == 3)[0])  # a (3, 8, 8) clip
        batch = ds.load([clip], latent_shape=(1, 4, 6))
        np.testing.assert_allclose(batch.latents[0], fit_latents(_expected(clip).latents, (1, 4, 6)), rtol=1e-6)
        with pytest.raises(ValueError, match="never padded"):
            ds.load([clip], latent_shape=(5, 8, 8))


def test_fit_crops_to_the_aspect_then_averages() -> None:
    x = np.arange(2 * 4 * 8, dtype=np.float32).reshape(1, 2, 4, 8)
    got = fit_latents(x, (1, 2, 2))  # 4×8 → crop to 4×4 (centre columns 2..5) → 2×2 box average
    centre = x[0, 0, :, 2:6]
    want = centre.reshape(2, 2, 2, 2).mean(axis=(1, 3))
    np.testing.assert_allclose(got[0, 0], want)
    for n_in, n_out in [(7, 3), (3, 7), (5, 5)]:
        np.testing.assert_allclose(resample_matrix(n_in, n_out).sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("policy", ["pad", "drop"])
def test_a_corrupt_sample_is_skipped_counted_and_reported(dataset: Path, policy: str) -> None:
    calls: list[tuple[str, int]] = []
    with open_dataset(
        str(dataset),
        max_bad_samples=2,
        on_skip=lambda r, n=1, distinct=0: calls.append((r, n, distinct)),
        bad_policy=policy,
    ) as ds:
        ids = _same_shape_ids(ds, 3)
        _corrupt(dataset, ds, ids[1])
        batch = ds.load(ids)
        if policy == "pad":
            assert batch.size == 3 and batch.valid.tolist() == [True, False, True]
            assert batch.sample_ids.tolist() == [ids[0], ids[2], ids[2]]  # the stand-in copies another row
            np.testing.assert_array_equal(batch.latents[1], batch.latents[2])
        else:
            assert batch.size == 2 and batch.valid.all()
            assert batch.sample_ids.tolist() == [ids[0], ids[2]] and batch.positions.tolist() == [0, 2]
        np.testing.assert_array_equal(batch.latents[0], _expected(ids[0]).latents)
        assert calls == [("corrupt", 1, 1)]
        assert ds.state_dict() == {"skipped_by_reason": {"corrupt": 1}, "bad_samples": {str(ids[1]): "corrupt"}}


def test_known_bad_samples_are_not_fetched_again(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=10) as ds:
        ids = _same_shape_ids(ds, 2)
        _corrupt(dataset, ds, ids[0])
        ds.load(ids)
        before = ds.storage.stats.requests
        ds.load(ids)
        assert ds.storage.stats.requests == before + 1  # only the good one
        assert ds.budget.skipped == 2  # every draw is counted ...
        assert len(ds.budget.distinct) == 1  # ... and the budget spends one sample once


def test_missing_and_truncated_shards(dataset: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_dataset(str(dataset), max_bad_samples=100) as ds:
        in_shard = {k: np.flatnonzero(ds.index.shard == k) for k in range(3)}
        (dataset / ds.index.shards[0]).unlink()
        shard1 = dataset / ds.index.shards[1]
        last = int(in_shard[1][-1])
        shard1.write_bytes(shard1.read_bytes()[: int(ds.index.span[last, 0]) + 10])
        for sid in in_shard[0]:
            assert not ds.load([sid]).valid.any()
        assert not ds.load([last]).valid.any()
        assert ds.load([int(in_shard[1][0])]).valid.all()  # the rest of shard 1 is intact
        assert ds.budget.by_reason == {"missing": len(in_shard[0]), "corrupt": 1}
    size = shard1.stat().st_size
    truncated = [r.getMessage() for r in caplog.records if "(truncated?)" in r.getMessage()]
    assert len(truncated) == 1 and f"but the file is {size:,} bytes long" in truncated[0], truncated


def test_all_rows_bad_gives_zero_rows_marked_invalid(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=10) as ds:
        ids = _same_shape_ids(ds, 2)
        for i in ids:
            _corrupt(dataset, ds, i)
        batch = ds.load(ids)
        assert batch.size == 2 and not batch.valid.any() and batch.sample_ids.tolist() == [-1, -1]
        assert not batch.latents.any()


def test_the_run_fails_clearly_past_max_bad_samples(dataset: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_dataset(str(dataset), max_bad_samples=1) as ds:
        ids = _same_shape_ids(ds, 3)
        for i in ids:
            _corrupt(dataset, ds, i)
        ds.load(ids[:1])
        with pytest.raises(
            TooManyBadSamples, match=r"2 distinct samples skipped, more than data\.maxBadSamples=1"
        ) as e:
            ds.load(ids[1:])
    message = str(e.value)
    assert message.count(f"sample {ids[1]}") == 1, message  # named once, not "sample N: sample N"
    # Skips are logged within the budget only; past it the run fails with the message above.
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping sample")]
    assert len(logged) == 1 and "1 of 1 allowed" in logged[0], logged


def test_skip_budget_is_restored_from_state(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=1) as ds:
        ds.load_state_dict({"skipped_by_reason": {"corrupt": 3}, "bad_samples": {"999999": "corrupt"}})
        ids = _same_shape_ids(ds, 1)
        _corrupt(dataset, ds, ids[0])
        with pytest.raises(TooManyBadSamples):
            ds.load(ids)
        with pytest.raises(ValueError, match="unknown skip reasons"):
            ds.load_state_dict({"skipped_by_reason": {"cosmic-rays": 1}})


def test_placeholder_rows_are_zero_and_invalid(dataset: Path) -> None:
    with open_dataset(str(dataset), max_bad_samples=0) as ds:
        batch = ds.placeholder((3, 8, 8))
        assert batch.latents.shape == (1, 4, 3, 8, 8) and not batch.valid.any() and batch.positions.tolist() == [-1]


def test_i2v_condition_round_trips(tmp_path: Path) -> None:
    variant = get_variant("tiny-i2v")
    mixture = (ShapeMix(5, 32, 32),)
    write_synthetic(str(tmp_path / "ds"), variant, 3, seed=1, mixture=mixture, dtype="bfloat16")
    with open_dataset(str(tmp_path / "ds"), max_bad_samples=0) as ds:
        batch = ds.load([0, 1, 2])
    assert batch.condition is not None and batch.condition.shape == (3, 8, 2, 4, 4)
    want = _expected(2, seed=1, variant=variant, mixture=mixture).condition
    np.testing.assert_allclose(batch.condition[2], want, rtol=1e-2, atol=1e-2)  # stored as bfloat16
    assert (batch.condition[:, :4, 0] == 1).all() and not batch.condition[:, :4, 1:].any()
