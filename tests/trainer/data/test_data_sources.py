"""Data preparation at corpus scale (issue #38, first part): manifests on GCS, clips cut from longer videos, work
units that any worker may (re)do at the same time, and a finalize that gives what one process gives.

The corpus sits in the GCS emulator as real media (PyAV-encoded MPEG-4, PNG) beside a JSONL manifest; it is read
where it is, through ranged reads, and encoded by the tiny Wan VAE / umT5 (diffusers and transformers models).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.data.bucketing import parse_bucket
from wanloom_trainer.data.format import EncodedSample
from wanloom_trainer.data.index import DatasetHeader
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.prepare.sources import read_sources, skip_kind
from wanloom_trainer.data.prepare.writer import DatasetWriter
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.storage import open_storage

BUCKETS = tuple(parse_bucket(b) for b in ("1x64x64", "1x64x96", "1x96x64", "9x64x64"))
ROOT = Path(__file__).resolve().parents[3]


def _config(inputs: str, output: str, model: Path) -> PrepareConfig:
    return PrepareConfig(
        inputs=inputs, output=output, model=model, variant="tiny", buckets=BUCKETS, batch_size=2, samples_per_shard=3,
        dtype="float32",
    )  # fmt: skip


def test_a_manifest_on_gcs_prepares_in_order_with_clip_bounds(corpus: str, gcs: str, tiny_model_root: Path) -> None:
    items = read_sources(corpus)
    assert [i.source for i in items] == [
        "cat", "media/b.jpg", f"{gcs}/media/clip.mp4", "media/broken.png", "media/long.mp4#0-1",
        "media/long.mp4#1.5-", "media/sub/c.png", "media/missing.png",
    ]  # fmt: skip
    assert items[1].caption == "a blue bird flies in the sky" and items[4].end == 1.0

    result = prepare(_config(corpus, f"{gcs}/out", tiny_model_root), progress=False)
    index = result.index
    assert list(index.sources) == [
        "cat", "media/b.jpg", f"{gcs}/media/clip.mp4", "media/long.mp4#0-1", "media/long.mp4#1.5-", "media/sub/c.png"
    ]  # fmt: skip
    # The first second of the 3 s clip is 16 frames: the 9-frame bucket; so is the 1.5 s from 1.5 s on.
    assert index.pixels[3].tolist() == [9, 64, 64] and index.pixels[4].tolist() == [9, 64, 64]
    reasons = {s["source"]: s["reason"] for s in result.skipped}
    assert reasons["media/broken.png"].startswith("undecodable") and reasons["media/missing.png"].startswith("missing")
    skipped = json.loads(open_storage(f"{gcs}/out").read("skipped.json"))
    assert [s["source"] for s in skipped] == ["media/broken.png", "media/missing.png"]
    with open_dataset(f"{gcs}/out", max_bad_samples=0) as ds:
        batch = ds.load([3], tuple(index.latent_shapes[3]))
        assert np.isfinite(batch.latents).all()


def test_work_units_done_by_several_workers_give_the_single_process_dataset(
    corpus: str, gcs: str, tiny_model_root: Path
) -> None:
    from wanloom_trainer.data.prepare.encoders import WanEncoders

    encoders = WanEncoders(tiny_model_root)
    single = prepare(_config(corpus, f"{gcs}/single", tiny_model_root), progress=False, encoders=encoders)
    config = _config(corpus, f"{gcs}/workers", tiny_model_root)
    # Unit 1 twice at the same time (a retried pod beside a slow one), unit 0 once, unit 2 by the finalizing run.
    # Threads stand in for pods: each its own encoders (the VAE keeps a per-call cache), loaded one at a time.
    own = [WanEncoders(tiny_model_root) for _ in range(3)]
    jobs = zip((1, 1, 0), own, strict=True)
    workers = [threading.Thread(target=prepare, args=(config,), kwargs={"progress": False, "units": [k],
                                "finalize": False, "encoders": e}) for k, e in jobs]  # fmt: skip
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out = open_storage(f"{gcs}/workers")
    assert not out.exists("index.json")
    with pytest.raises(ValueError, match=r"1 of 3 work units are not written yet \(2\)"):
        DatasetWriter.resume(out).finalize()
    final = prepare(config, progress=False, encoders=encoders)
    assert final.index.to_json() == single.index.to_json()
    assert sorted(n for n in out.list("shards") if n.endswith(".tar")) == [
        f"shards/shard-{k:06d}.tar" for k in range(3)
    ]
    reference = open_storage(f"{gcs}/single")
    for k in range(3):
        assert out.read(f"shards/shard-{k:06d}.tar") == reference.read(f"shards/shard-{k:06d}.tar")


@pytest.mark.parametrize("where", ["path", "emulator"])
def test_two_writers_of_one_shard_with_other_bytes_leave_one_consistent_shard(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An encoder that is not bit-exact across devices: the second tar gets its own name, the first manifest
    decides, the loser removes its tar, and the index reads back the winner's bytes."""
    root = str(tmp_path / "ds") if where == "path" else request.getfixturevalue("gcs")
    header = DatasetHeader("tiny", 4, 0, 8, 4, "float32", "prepare", {})

    def sample(value: float) -> EncodedSample:
        return EncodedSample(
            key="s000000000", latents=np.full((4, 1, 2, 2), value, np.float32), text=np.ones((2, 8), np.float32),
            condition=None, source="x.png", frames=1, height=16, width=16, fps=0.0, caption="x",
        )  # fmt: skip

    first, second = DatasetWriter(open_storage(root), header, 1), DatasetWriter(open_storage(root), header, 1)
    first.start()
    first.write_shard(0, [sample(1.0)])
    second.write_shard(0, [sample(2.0)])  # other bytes, and its manifest loses
    storage = open_storage(root)
    assert storage.list("shards") == ["shards/shard-000000.json", "shards/shard-000000.tar"]
    index = first.finalize()
    with open_dataset(root, max_bad_samples=0) as ds:
        assert ds.load([0], tuple(index.latent_shapes[0])).latents.max() == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"caption": "x"}', r"bad-row: manifest {m} row 1: 'path' must name the media file"),
        ('{"path": "a.png"}', r"no-caption: manifest {m} row 1: needs a non-empty 'caption' or a 'caption_path'"),
        ('{"path": "a.png", "caption_path": "gone.txt"}', r"no-caption: manifest {m} row 1: caption_path .*gone"),
        ('{"path": "a.txt", "caption": "x"}', r"bad-row: manifest {m} row 1: path 'a.txt' is neither an image nor"),
        ('{"path": "a.mp4", "caption": "x", "start": 2, "end": 1}', r"bad-row: manifest {m} row 1: end 1 s must be"),
        ('{"path": "a.mp4", "caption": "x", "start": "soon"}', r"bad-row: manifest {m} row 1: 'start' must be seconds"),
        ('{"path": "a.png", "caption": "x", "begin": 1}', r"bad-row: manifest {m} row 1: unknown field\(s\) begin"),
        ('{"path": "b.png", "caption": "y", "id": "k"}\n{"path": "a.png", "caption": "x", "id": "k"}',
         r"duplicate-id: manifest {m} row 2: id 'k' repeats row 1"),
        ("[1, 2]", r"bad-row: manifest {m} line 1: a row must be a JSON object"),
        ('{"path": ', r"bad-row: manifest {m} line 1: not JSON"),
    ],
)  # fmt: skip
def test_a_bad_manifest_row_is_skipped_in_place_with_its_row_and_field(tmp_path: Path, text: str, message: str):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(text + '\n{"path": "good.png", "caption": "fine"}\n')
    items = read_sources(str(manifest))
    bad, good = items[-2], items[-1]
    assert re.match(message.format(m=re.escape(str(manifest))), bad.problem or ""), bad.problem
    assert good.problem is None and good.caption == "fine" and good.ordinal == len(items) - 1  # order kept
    assert skip_kind(bad.problem or "") == (bad.problem or "").split(":")[0]


def test_csv_and_parquet_manifests_and_the_units_command(tmp_path: Path, media_set) -> None:  # type: ignore[no-untyped-def]
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = tmp_path / "m.csv"
    lines = ["path,caption,start,end"] + [f"{media_set.folder / n},caption {i},," for i, n in enumerate(media_set.good)]
    manifest.write_text("\n".join(lines) + "\n")
    items = read_sources(str(manifest))
    assert [i.caption for i in items] == [f"caption {i}" for i in range(4)] and items[0].start is None
    table = pa.table({"path": [str(media_set.folder / n) for n in media_set.good], "caption": ["c"] * 4,
                      "start": [None, None, 0.5, None], "id": [f"k{i}" for i in range(4)]})  # fmt: skip
    pq.write_table(table, tmp_path / "m.parquet")
    parquet = read_sources(str(tmp_path / "m.parquet"))
    assert [i.source for i in parquet] == ["k0", "k1", "k2", "k3"] and parquet[2].start == 0.5
    with pytest.raises(ValueError, match=r"the CSV header must name a 'path' column"):
        (tmp_path / "bad.csv").write_text("file,caption\na.png,x\n")
        read_sources(str(tmp_path / "bad.csv"))
    code = "import sys; from wanloom_cli import main; sys.argv = ['wanloom', *sys.argv[1:]]; main()"
    args = ["data", "units", str(manifest), "--samples-per-shard", "3"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"
