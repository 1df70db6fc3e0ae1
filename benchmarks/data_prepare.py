"""Data preparation on this CPU with the tiny encoders: time per sample in each stage, pipeline efficiency, and
1 -> 2 workers pinned to their own cores; then, from the encoders' FLOPs, clips/hour per H100/H200 at A14B 480p.

The corpus is generated here: ``--clips`` MPEG-4 clips (33 frames at 16 fps, 96x128, moving gradients) and
``--images`` PNGs, captioned, in a folder; units of ``--per-unit`` sources. The stages are the pipeline's own
(``data/prepare/stages.py``): read, decode and resize run on the pool of ``WANLOOM_DECODE_WORKERS`` processes,
vae and text in the main process, write on a thread. Pipeline efficiency = wall time / slowest stage, where a
stage's time is its seconds over its parallelism (the pool's workers, or 1); 1.0 means the pipeline runs as fast
as its slowest stage allows.

"1 -> 2 pods" stands in for two encode pods with a CPU limit each: work units split over two processes, each pinned
to its own core (``os.sched_setaffinity``), against one process pinned to one core doing every unit. It is not the
real node's kubelet and cgroups.

Run: ``PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/data_prepare.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from wanloom_trainer.data.bucketing import parse_bucket
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.prepare.stages import STAGES, PrepareProgress
from wanloom_trainer.flops import ACCELERATORS

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("1x64x64", "1x96x128", "33x96x128", "17x64x64")
CPU_STAGES = ("read", "decode", "resize")
# Wan 2.1 VAE encode of one 81x480x832 clip (A14B's VAE): XLA's FLOP estimate for model/encoders/vae_jax.py, from
# benchmarks/encoders_tpu_compile.py (docs/benchmarks.md). umT5-XXL's encoder (~5.7e9 parameters) over Wan's
# 512 padded tokens: 2 FLOP per parameter per token.
VAE_480P_81_FLOP = 164e12
UMT5_XXL_FLOP = 2 * 5.7e9 * 512
ASSUMED_MFU = 0.30


def _tiny_media() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_media", ROOT / "tests" / "trainer" / "data" / "tiny_media.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(folder: Path, clips: int, images: int) -> None:
    from PIL import Image

    tiny = _tiny_media()
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(clips):
        tiny.write_video(folder / f"clip{i:03d}.mp4", frames=33, height=96, width=128, fps=16)
        (folder / f"clip{i:03d}.txt").write_text("a dog runs on the grass")
    for i in range(images):
        Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text("a red cat sits in the sky")


def _config(media: Path, output: Path, model: Path, per_unit: int) -> PrepareConfig:
    return PrepareConfig(
        inputs=media,
        output=str(output),
        model=model,
        variant="tiny",
        buckets=tuple(parse_bucket(b) for b in BUCKETS),
        batch_size=4,
        samples_per_shard=per_unit,
        dtype="bfloat16",
    )


def _run(config: PrepareConfig, workers: int, units: list[int] | None = None) -> tuple[float, PrepareProgress]:
    total = PrepareProgress()
    started = time.perf_counter()
    prepare(config, progress=False, workers=workers, units=units, finalize=units is None, on_progress=total.add)
    return time.perf_counter() - started, total


def _pinned(args: tuple[PrepareConfig, int, list[int], int]) -> float:
    import torch

    config, workers, units, core = args
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)  # as OMP_NUM_THREADS in a pod limited to one CPU: no threads fighting for the core
    return _run(config, workers, units)[0]


def _row(name: str, wall: float, total: PrepareProgress, workers: int) -> str:
    per = {s: total.seconds[s] / max(total.samples, 1) * 1000 for s in STAGES}
    lanes = {
        "cpu pool": sum(total.seconds[s] for s in CPU_STAGES) / max(workers, 1),
        "encoders": total.seconds["vae"] + total.seconds["text"],
        "write": total.seconds["write"],
    }
    slowest = max(lanes, key=lanes.__getitem__)
    cells = " | ".join(f"{per[s]:.1f}" for s in STAGES)
    return (
        f"| {name} | {total.samples} | {cells} | {wall:.1f} s | {slowest} {lanes[slowest]:.1f} s "
        f"| {wall / lanes[slowest]:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--per-unit", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wanloom-bench-prepare-") as tmp:
        root = Path(tmp)
        _corpus(root / "media", args.clips, args.images)
        model = _tiny_media().write_tiny_encoders(root / "encoders")
        cores = sorted(os.sched_getaffinity(0))
        print(f"{args.clips} clips (33x96x128) + {args.images} images, units of {args.per_unit}, {len(cores)} CPUs")
        print(f"| run | samples | {' | '.join(f'{s} ms/sample' for s in STAGES)} | wall | slowest lane | efficiency |")
        print("|---|---|" + "---|" * len(STAGES) + "---|---|---|")
        _run(_config(root / "media", root / "warm", model, args.per_unit), 0)  # imports, first-call costs
        for name, workers in (("in one process (0 workers)", 0), (f"pool of {len(cores) - 1}", len(cores) - 1)):
            wall, total = _run(_config(root / "media", root / f"out-{workers}", model, args.per_unit), workers)
            print(_row(name, wall, total, workers))

        units = list(range(-(-(args.clips + args.images) // args.per_unit)))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            one = pool.map(_pinned, [(_config(root / "media", root / "one", model, args.per_unit), 0, units, cores[0])])
        if len(cores) >= 2:
            halves = [units[0::2], units[1::2]]
            two_config = _config(root / "media", root / "two", model, args.per_unit)
            jobs = [(two_config, 0, half, core) for half, core in zip(halves, cores[:2], strict=True)]
            started = time.perf_counter()
            with ctx.Pool(2) as pool:
                pool.map(_pinned, jobs)
            two = time.perf_counter() - started
            print(f"1 -> 2 pinned workers (one core each, {len(units)} units): {one[0]:.1f} s -> {two:.1f} s, "
                  f"{one[0] / two:.2f}x")  # fmt: skip

    print("\nprojection for Wan 2.2 A14B (Wan 2.1 VAE) at 81x480x832, from FLOPs, not measured:")
    per_clip = VAE_480P_81_FLOP + UMT5_XXL_FLOP
    for key in ("h100", "h200"):
        peak = ACCELERATORS[key].peak_bf16_flops
        bound, assumed = 3600 * peak / per_clip, 3600 * peak * ASSUMED_MFU / per_clip
        gpus = -(-1_000_000 // int(24 * assumed))
        pods = -(-gpus // 8)
        print(
            f"  {key}: {per_clip / 1e12:.0f} TFLOP per clip; <= {bound:,.0f} clips/h per GPU at peak, "
            f"{assumed:,.0f} at {ASSUMED_MFU:.0%} MFU -> {gpus} GPUs ({pods} pods of 8) for 1M clips/day"
        )


if __name__ == "__main__":
    main()
