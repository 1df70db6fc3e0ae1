"""Storage: local paths and gs:// on the emulator, range reads, retries through injected faults, streaming."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.outage import StorageOutage
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.shards import stream_shard
from wanloom_trainer.data.storage import (
    GCSStorage,
    LocalStorage,
    MissingObject,
    RetryPolicy,
    TransientStorageError,
    open_storage,
    split_uri,
)
from wanloom_trainer.data.synthetic import write_synthetic

TINY = get_variant("tiny")
FAST = RetryPolicy(attempts=4, initial_delay=0.001, max_delay=0.01)


def _all_rows(uri: str, **kw: object) -> tuple[np.ndarray, np.ndarray, object]:
    """Every sample loaded one by one: (latents flattened and concatenated, text, dataset)."""
    ds = open_dataset(uri, max_bad_samples=kw.pop("max_bad_samples", 0), retry=FAST, **kw)  # type: ignore[arg-type]
    batches = [ds.load([i]) for i in range(ds.num_samples)]
    ds.close()
    lat = np.concatenate([b.latents.ravel() for b in batches])
    txt = np.concatenate([b.text_embeds.ravel() for b in batches])
    return lat, txt, ds


def test_emulator_round_trip_equals_local(tmp_path: Path, gcs: str) -> None:
    write_synthetic(str(tmp_path), TINY, 12, seed=4, samples_per_shard=5)
    write_synthetic(gcs, TINY, 12, seed=4, samples_per_shard=5)
    local_lat, local_txt, _ = _all_rows(str(tmp_path))
    gcs_lat, gcs_txt, ds = _all_rows(gcs)
    np.testing.assert_array_equal(gcs_lat, local_lat)
    np.testing.assert_array_equal(gcs_txt, local_txt)
    # One range request per sample, each only the sample's own bytes: no whole-shard downloads.
    assert ds.storage.stats.requests == 12
    assert ds.storage.stats.bytes_read == int(ds.index.span[:, 1].sum())


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_flaky_emulator_is_survived_by_retries(tmp_path: Path, flaky_gcs, mode: str) -> None:
    uri, proxy = flaky_gcs
    write_synthetic(str(tmp_path), TINY, 12, seed=4, samples_per_shard=5)
    write_synthetic(uri, TINY, 12, seed=4, samples_per_shard=5)
    proxy.fail_every, proxy.mode = 3, mode
    lat, txt, ds = _all_rows(uri)
    local_lat, local_txt, _ = _all_rows(str(tmp_path))
    np.testing.assert_array_equal(lat, local_lat)
    np.testing.assert_array_equal(txt, local_txt)
    assert proxy.injected >= 4
    assert ds.storage.stats.retries == proxy.injected  # each injected fault cost exactly one retry
    assert ds.budget.skipped == 0


def test_an_outage_waits_instead_of_skipping_and_heals(flaky_gcs) -> None:
    """Storage down past the per-request retries: the load waits (nothing skipped, the budget untouched, the outage
    gauge rising) and returns the real rows once storage is back."""
    uri, proxy = flaky_gcs
    write_synthetic(uri, TINY, 4, seed=0, samples_per_shard=4)
    skipped: list[str] = []
    outage: list[float] = []
    with open_dataset(
        uri, max_bad_samples=0, retry=FAST, on_skip=lambda r, n=1, **_: skipped.append(r),
        storage_outage_s=60, on_outage=outage.append,
    ) as ds:  # fmt: skip
        proxy.fail_every = 1  # every download fails
        loading = ThreadPoolExecutor(1).submit(ds.load, [0])
        deadline = time.monotonic() + 30
        while not (outage and outage[-1] > 0.5):
            assert time.monotonic() < deadline and not loading.done(), (outage, loading)
            time.sleep(0.05)
        proxy.fail_every = 0  # the outage ends
        batch = loading.result(timeout=30)
    assert batch.valid.all() and skipped == [] and ds.budget.skipped == 0
    assert outage[-1] == 0.0 and max(outage) > 0.5


def test_an_outage_longer_than_the_limit_fails_with_the_field_to_raise(flaky_gcs) -> None:
    uri, proxy = flaky_gcs
    write_synthetic(uri, TINY, 4, seed=0, samples_per_shard=4)
    with open_dataset(uri, max_bad_samples=0, retry=FAST, storage_outage_s=1) as ds:
        proxy.fail_every = 1
        with pytest.raises(StorageOutage, match=r"unreachable for \d+ s \(spec\.data\.storageOutageSeconds=1\)"):
            ds.load([0])
        assert ds.budget.skipped == 0  # an outage is never a bad sample


def test_corrupt_object_on_gcs_is_counted(gcs: str) -> None:
    write_synthetic(gcs, TINY, 4, seed=0, samples_per_shard=4)
    storage = open_storage(gcs)
    with open_dataset(gcs, max_bad_samples=5, retry=FAST) as ds:
        shard = ds.index.shards[0]
        blob = bytearray(storage.read(shard))
        blob[int(ds.index.span[2, 0]) + 200] ^= 0x55
        storage.write(shard, bytes(blob))
        valid = [bool(ds.load([i]).valid[0]) for i in range(4)]
    assert valid == [True, True, False, True] and ds.budget.by_reason == {"corrupt": 1}


def test_missing_objects_are_not_retried(gcs: str) -> None:
    storage = GCSStorage(gcs, FAST)
    with pytest.raises(MissingObject, match="not found"):
        storage.read_range("nope.tar", 0, 10)
    assert storage.stats.retries == 0
    with pytest.raises(FileNotFoundError, match=r"no shape index at gs://.*/index\.json"):
        open_dataset(gcs, max_bad_samples=0)


def test_streaming_a_shard_from_gcs(gcs: str) -> None:
    index = write_synthetic(gcs, TINY, 6, seed=0, samples_per_shard=6)
    with open_storage(gcs).open_stream(index.shards[0]) as stream:
        keys = [k for k, _ in stream_shard(stream)]
    assert keys == list(index.keys)


def test_retry_gives_up_with_a_clear_error() -> None:
    import requests

    storage = GCSStorage("gs://bucket/prefix", RetryPolicy(attempts=3, initial_delay=0.0, sleep=lambda _: None))
    calls = []

    def always_down() -> bytes:
        calls.append(1)
        raise requests.ConnectionError("connection reset")

    with pytest.raises(TransientStorageError, match="gs://bucket/prefix/x: gave up after 3 attempts"):
        storage._call("gs://bucket/prefix/x", always_down)
    assert len(calls) == 3 and storage.stats.retries == 2


def test_permanent_errors_are_raised_at_once() -> None:
    from google.api_core import exceptions as gexc

    storage = GCSStorage("gs://bucket", RetryPolicy(attempts=5, sleep=lambda _: None))
    with pytest.raises(gexc.Forbidden):
        storage._call("x", lambda: (_ for _ in ()).throw(gexc.Forbidden("no")))
    assert storage.stats.retries == 0


def test_local_storage_writes_atomically_and_reads_ranges(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.write("a/b.bin", b"0123456789")
    assert storage.read_range("a/b.bin", 3, 4) == b"3456"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]  # no temporary files left behind
    with pytest.raises(EOFError, match=r"wanted bytes 8\.\.11, but the file is 10 bytes long"):
        storage.read_range("a/b.bin", 8, 4)
    with pytest.raises(MissingObject):
        storage.read("a/none")
    with storage.open_stream("a/b.bin") as f:
        assert io.BufferedReader(f).read() == b"0123456789"


@pytest.mark.parametrize(
    ("uri", "split"),
    [
        ("gs://b/p/index.json", ("gs://b/p", "index.json")),
        ("gs://b/index.json", ("gs://b", "index.json")),
        ("data/index.json", ("data", "index.json")),
        ("index.json", (".", "index.json")),
    ],
)
def test_split_uri(uri: str, split: tuple[str, str]) -> None:
    assert split_uri(uri) == split


def test_bad_uris() -> None:
    with pytest.raises(ValueError, match="unsupported dataset URI 's3://x'"):
        open_storage("s3://x")
    with pytest.raises(ValueError, match="names no bucket"):
        GCSStorage("gs://")


def test_range_past_the_end_is_a_truncation(gcs: str) -> None:
    storage = GCSStorage(gcs, FAST)
    storage.write("x.bin", b"0123456789")
    with pytest.raises(EOFError, match=r"wanted bytes 8\.\.11, got 2 "):
        storage.read_range("x.bin", 8, 4)
    with pytest.raises(EOFError):
        storage.read_range("x.bin", 20, 4)
