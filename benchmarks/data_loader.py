"""Data loader throughput at Wan 2.2 A14B 720p shapes, from local disk and from the GCS emulator.

Each sample is a 720×1280×81 clip's latent (16×21×90×160, bfloat16, 9.7 MB) plus a full umT5 output (512×4096,
bfloat16, 4.2 MB): 13.9 MB stored, 27.7 MB as the float32 arrays the trainer receives. The loader reads them the
way a training run does: a plan of one-sample micro-batches in shuffled order, ``PlanPrefetcher`` loading
``depth`` micro-batches ahead, each a byte-range read + CRC-32 + bfloat16 → float32 widening.

Demand to compare against (seed 000, maxdiffusion PR #470, Wan 2.2 A14B on TPU v7x): 13.57 s/step with
fsdp=16 × cp=4 over 64 devices; a 75,600-token sample split over cp=4 devices (18,900 tokens each) means 16
samples per step, i.e. 1.18 samples/s for the whole job, or 0.15 samples/s for each of its 8 hosts.

Run: ``PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/data_loader.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan
from wanloom_trainer.data.format import EncodedSample
from wanloom_trainer.data.index import DatasetHeader
from wanloom_trainer.data.prefetch import PlanPrefetcher
from wanloom_trainer.data.prepare.writer import DatasetWriter
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.storage import open_storage

LATENT = (16, 21, 90, 160)
TEXT = (512, 4096)
SEED_STEP_S = 13.57
SEED_GLOBAL_BATCH = 16
SEED_HOSTS = 8


def write_dataset(uri: str, samples: int) -> float:
    """Write ``samples`` A14B-720p samples (random values) at ``uri``; returns stored MB per sample."""
    header = DatasetHeader("wan2.2-t2v-a14b", 16, 0, 4096, 512, "bfloat16", "synthetic", {"benchmark": samples})
    writer = DatasetWriter(open_storage(uri), header, num_shards=max(1, samples // 8))
    rng = np.random.default_rng(0)
    per_shard = -(-samples // writer.num_shards)
    for k in writer.start():
        ids = range(k * per_shard, min(samples, (k + 1) * per_shard))
        writer.write_shard(k, (_sample(i, rng) for i in ids))
    index = writer.finalize()
    return float(index.span[:, 1].mean()) / 1e6


def _sample(i: int, rng: np.random.Generator) -> EncodedSample:
    return EncodedSample(
        key=f"b{i:06d}",
        latents=rng.standard_normal(LATENT, dtype=np.float32),
        text=rng.standard_normal(TEXT, dtype=np.float32),
        condition=None,
        source=f"bench:{i}",
        frames=81,
        height=720,
        width=1280,
        fps=16.0,
    )


def plans(samples: int, seed: int) -> list[StepPlan]:
    order = np.random.default_rng(seed).permutation(samples)
    return [
        StepPlan(s, (RankPlan((MicroBatch((int(i),), LATENT[1:], 0, (500.0,), (1.0,)),), 0.0),), 1)
        for s, i in enumerate(order)
    ]


def measure(uri: str, samples: int, workers: int, depth: int, seed: int) -> tuple[float, float]:
    """(samples/s, stored MB/s read) for one pass over the dataset in plan order."""
    with open_dataset(uri, max_bad_samples=0, workers=workers) as ds:
        start = time.perf_counter()
        with PlanPrefetcher(ds, plans(samples, seed), rank=0, depth=depth, workers=workers) as pf:
            rows = sum(mb.batch.size for step in pf for mb in step)
        elapsed = time.perf_counter() - start
        assert rows == samples
        return samples / elapsed, ds.storage.stats.bytes_read / 1e6 / elapsed


def median_of(repeats: int, fn: Callable[[int], tuple[float, float]]) -> tuple[float, float]:
    runs = [fn(r) for r in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def start_emulator() -> tuple[object, str]:
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bench")
    server.start()
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    return server, "gs://bench/a14b-720p"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,4", help="comma-separated reader thread counts")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--no-emulator", action="store_true")
    args = parser.parse_args()

    demand = SEED_GLOBAL_BATCH / SEED_STEP_S
    rows = []
    with tempfile.TemporaryDirectory(prefix="wanloom-bench-") as tmp:
        targets = {"local disk": tmp}
        server = None
        if not args.no_emulator:
            server, targets["GCS emulator"] = start_emulator()
        try:
            for name, uri in targets.items():
                mb = write_dataset(uri, args.samples)
                for w in (int(x) for x in args.workers.split(",")):
                    rate, mbps = median_of(
                        args.repeats, lambda r, uri=uri, w=w: measure(uri, args.samples, w, args.depth, r)
                    )
                    rows.append((name, w, rate, mbps, rate / demand, rate * SEED_HOSTS / demand))
        finally:
            if server is not None:
                server.stop()  # type: ignore[attr-defined]
    print(f"sample: latent {'x'.join(map(str, LATENT))} + text {'x'.join(map(str, TEXT))}, bf16, {mb:.1f} MB stored")
    print(
        f"demand (seed 000): {SEED_GLOBAL_BATCH} samples / {SEED_STEP_S} s = {demand:.2f} samples/s per job, "
        f"{demand / SEED_HOSTS:.3f} per host"
    )
    print("| source | reader threads | samples/s | MB/s (stored) | × job demand | × per-host demand |")
    print("|---|---|---|---|---|---|")
    for name, w, rate, mbps, job, host in rows:
        print(f"| {name} | {w} | {rate:.2f} | {mbps:.0f} | {job:.1f} | {host:.1f} |")


if __name__ == "__main__":
    main()
