"""Wan 2.2 T2V-A14B at 720p × 81 frames (75,600 tokens) compiled for TPU v7x on this host: memory per device.

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/tpu_compile.py [--remat none full] [--json]

For the example job (`jobs/t2v-a14b-tpu7x-2x4x4x4.yaml`: 2 × tpu7x 4x4x4, data 2 × fsdp 32 × context 4) and the
same job on one 4x4x4 slice (data 1), with each remat policy, `wanloom compile`'s programs (`backends/jax/compile.py`:
the job's mesh, fused AdaLN, splash attention and its largest micro-batch, both experts' state resident) are
compiled at ``--depths`` layers, by default the model's 40: the blocks run as one scan, so compile time does not
grow with depth. Shallower depths are extended to 40 layers by the line through them (every term is affine in the
number of identical blocks). Capacity: 96 GiB per JAX device (192 GiB per chip, 2 TensorCores); seed 000 reports
94.7 GB usable and 112.7 GB needed before ring attention.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from wanloom_api.validation import load_trainingjob_file
from wanloom_trainer.backends.jax.compile import HBM_BYTES_PER_DEVICE, compile_job

JOB = Path(__file__).resolve().parents[1] / "jobs" / "t2v-a14b-tpu7x-2x4x4x4.yaml"
REMATS = ("none", "save-attention", "save-matmuls", "full")
LAYERS = 40


def one_slice(job: Any) -> Any:
    """The example job on a single 4x4x4 slice: data 1, fsdp fills the slice, context 4."""
    tpu = job.spec.resources.tpu.model_copy(update={"slices": 1})
    spec = job.spec.model_copy(
        update={
            "resources": job.spec.resources.model_copy(update={"tpu": tpu}),
            "parallelism": job.spec.parallelism.model_copy(update={"data": 1}),
        }
    )
    return job.model_copy(update={"spec": spec})


def extend(depths: list[int], values: list[float], depth: int) -> float:
    """The affine function through (depths, values), at ``depth`` (a single point scales proportionally)."""
    if len(depths) == 1:
        return values[0] * depth / depths[0]
    slope = (values[-1] - values[0]) / (depths[-1] - depths[0])
    return values[0] + slope * (depth - depths[0])


def case(name: str, job: Any, remat: str, depths: list[int]) -> dict[str, Any]:
    reports, seconds = [], []
    for d in depths:
        start = time.perf_counter()
        reports.append(compile_job(job, layers=d, remat=remat))
        seconds.append(time.perf_counter() - start)
    peak = extend(depths, [r.peak_bytes_per_device for r in reports], LAYERS)
    resident = extend(depths, [r.resident_bytes for r in reports], LAYERS)
    capacity = HBM_BYTES_PER_DEVICE["tpu7x"]
    step = next(p for p in reports[-1].programs if p.program == "accumulate")
    return {
        "case": name, "remat": remat, "devices": reports[0].devices, "mesh": reports[0].mesh,
        "rows_per_rank": step.rows_per_rank, "tokens_per_row": step.tokens_per_row,
        "compiled_depths": depths, "compile_seconds": seconds,
        "resident_bytes_40": resident, "peak_bytes_40": peak, "fits": peak <= capacity,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remat", nargs="+", default=list(REMATS), choices=REMATS)
    parser.add_argument("--depths", type=int, nargs="+", default=[LAYERS], help="layers to compile at")
    parser.add_argument("--cases", nargs="+", default=["1x4x4x4", "2x4x4x4"], choices=["1x4x4x4", "2x4x4x4"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    job = load_trainingjob_file(JOB)
    jobs = {"1x4x4x4": one_slice(job), "2x4x4x4": job}
    rows = [case(name, jobs[name], remat, args.depths) for name in args.cases for remat in args.remat]
    if args.json:
        print(json.dumps(rows))
        return
    gb = lambda n: f"{n / 1e9:.1f} GB"
    print("| slices × topology | devices | remat | rows × tokens per rank | compile s (depths) | resident @40 | "
          "peak @40 / device | fits 96 GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        secs = ", ".join(f"{s:.0f} ({d})" for s, d in zip(r["compile_seconds"], r["compiled_depths"], strict=True))
        print(
            f"| {r['case']} | {r['devices']} | {r['remat']} | {r['rows_per_rank']} × {r['tokens_per_row']:,} | "
            f"{secs} | {gb(r['resident_bytes_40'])} | {gb(r['peak_bytes_40'])} | {'yes' if r['fits'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
