"""A few real training steps of the torch trainer on this machine's device, beside `wanloom compile`'s estimate.

The job is one of the A14B/5B architectures cut to a few layers (or the tiny model), on every local GPU
(``--context`` of them splitting each sample's sequence): ``TorchBackend`` itself builds it (FSDP2, fused AdaLN,
``torch.compile`` of the blocks when asked, flash attention on CUDA), trains ``--steps`` steps of one micro-batch
per rank at the job's token count, and reports the median step time after the first (compile) steps, MFU against
the GPU's dense bf16 peak (``flops.py``), and the peak memory PyTorch allocated, beside the FSDPMemTracker estimate
of the same job (``backends/torch/compile.py``, run in a process of its own).

    PYTHONPATH=operator:trainer_images python benchmarks/gpu_train_step.py --variant wan2.2-ti2v-5b --layers 4 \
        --shape 33x480x832 --compile --adaln fused          # one GPU
    torchrun-free: with N GPUs it starts N workers through wanloom_trainer.launcher (--gpus N --context 2)
    PYTHONPATH=operator:trainer_images python benchmarks/gpu_train_step.py --cpu   # the tiny model, a smoke run

Prints one JSON object per run (``--json``) or a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def job_document(args: argparse.Namespace) -> dict:
    gpu = not args.cpu
    frames, height, width = (int(v) for v in args.shape.split("x"))
    resources = {"gpu": {"type": args.gpu_type, "perNode": args.gpus, "nodes": 1}} if gpu else {"cpu": {"nodes": 1}}
    return {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "gpu-train-step"},
        "spec": {
            "model": {
                "variant": args.variant,
                "paramDtype": "float32",
                "computeDtype": "bfloat16" if gpu else "float32",
            },
            "data": {"uri": "/nonexistent"},
            "adaptiveLoad": {
                "memoryBudgetTokens": args.tokens or 1,
                "buckets": [{"frames": frames, "height": height, "width": width}],
            },
            "kernels": {
                "adaln": args.adaln,
                "attention": "flash" if gpu else "sdpa",
                "compile": "blocks" if args.compile else "none",
            },
            "parallelism": {"fsdp": -1, "context": args.context, "remat": args.remat},
            "training": {"steps": args.steps, "globalBatch": max(1, args.gpus // args.context)},
            "resources": {**resources, "backend": "torch"},
        },
    }


def worker(job_path: str, steps: int, layers: int | None, shape: str) -> None:
    """One rank: TorchBackend trains ``steps`` steps of one micro-batch of the job's bucket; rank 0 prints JSON."""
    import dataclasses

    import numpy as np
    import torch

    from wanloom_api.validation import load_trainingjob_file
    from wanloom_trainer.adaptiveload.sizing.tokens import latent_shapes_for_pixels
    from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
    from wanloom_trainer.backends.objective import batch_noise
    from wanloom_trainer.backends.torch.backend import TorchBackend
    from wanloom_trainer.config.train_config import from_trainingjob
    from wanloom_trainer.flops import mfu, train_flops_per_step

    config = from_trainingjob(load_trainingjob_file(job_path), {"WANLOOM_RUN_DIR": tempfile.mkdtemp()})
    if layers is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=layers))
    backend = TorchBackend(config.backend_config)
    wan = config.model.wan
    latent = tuple(int(v) for v in latent_shapes_for_pixels(wan, [[int(v) for v in shape.split("x")]])[0])
    tokens = wan.tokens(*latent)
    rows = max(1, config.adaptive_load.memory_budget_tokens // tokens)
    state = backend.init_state()
    rng = np.random.default_rng(backend.dp_rank)
    times = []
    for step in range(steps):
        ids = list(range(backend.dp_rank * rows, (backend.dp_rank + 1) * rows))
        data = RankRows(
            sample_ids=np.asarray(ids),
            latents=rng.standard_normal((rows, wan.out_channels, *latent), dtype=np.float32),
            text=rng.standard_normal((rows, wan.text_len, wan.text_dim), dtype=np.float32),
            noise=batch_noise(0, step, ids, (wan.out_channels, *latent)),
            timesteps=np.full(rows, 950.0, np.float32),
            weights=np.full(rows, 1.0 / (rows * backend.dp_size), np.float32),
            condition=rng.standard_normal((rows, wan.condition_channels, *latent), dtype=np.float32)
            if wan.condition_channels
            else None,
        )
        experts = config.model.num_experts
        samples = rows * backend.dp_size
        inputs = StepInputs(
            step, [Slot(0, {backend.dp_rank: data})], samples, (samples, 0)[:experts], (1e-5, 1e-5)[:experts]
        )
        start = time.perf_counter()
        state, out = backend.train_step(state, inputs)
        times.append(time.perf_counter() - start)
    if backend.process_index == 0:
        steady = statistics.median(times[2:] if len(times) > 3 else times[-1:])
        flops = train_flops_per_step(wan, [tokens] * rows * backend.dp_size)
        cuda = backend.device.type == "cuda"
        result = {
            "device": torch.cuda.get_device_name(backend.device) if cuda else "cpu",
            "ranks": backend.process_count,
            "context": config.parallel.context,
            "layers": wan.num_layers,
            "rows_per_rank": rows,
            "tokens_per_row": tokens,
            "first_step_s": times[0],
            "steady_step_s": steady,
            "tokens_per_s": rows * backend.dp_size * tokens / steady,
            "mfu": mfu(flops, steady, backend.process_count, config.accelerator_type) if cuda else None,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(backend.device) if cuda else None,
            "loss": out.experts[0].loss_sum,
        }
        print("RESULT " + json.dumps(result), flush=True)
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="wan2.2-ti2v-5b")
    parser.add_argument("--layers", type=int, help="blocks of the model (default: 4; --cpu: the tiny model's 2)")
    parser.add_argument("--shape", default="33x480x832", help="pixels FxHxW of the micro-batch's bucket")
    parser.add_argument("--tokens", type=int, help="memoryBudgetTokens (default: one sample per micro-batch)")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-type", default="h200")
    parser.add_argument("--context", type=int, default=1)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--adaln", default="fused")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (kernels.compile: blocks)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cpu", action="store_true", help="the tiny model on this CPU (a smoke run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.layers, args.shape)
        return
    if args.layers is None and not args.cpu:
        args.layers = 4
    if args.cpu:  # the tiny model, one process, the eager kernels: what this CPU can run in seconds
        args.variant, args.layers, args.shape, args.gpus, args.context = "tiny", None, "9x64x64", 1, 1
        args.remat, args.adaln = "none", "reference"
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp, "job.yaml")
        job.write_text(yaml.safe_dump(job_document(args)))
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer_images'}"}
        estimate = None
        if not args.cpu:
            layers = [] if args.layers is None else ["--layers", str(args.layers)]
            cli = [sys.executable, "-c", "from wanloom_cli import main; main()", "compile", str(job), "--json"]
            sized = subprocess.run([*cli, *layers], env=env, capture_output=True, text=True)
            estimate = json.loads(sized.stdout) if sized.returncode in (0, 1) and sized.stdout else None
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(job), "--steps", str(args.steps),
                   "--shape", args.shape, *([] if args.layers is None else ["--layers", str(args.layers)])]  # fmt: skip
        master = {"NNODES": "1", "NPROC_PER_NODE": str(args.gpus), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "29511"}  # fmt: skip
        launcher = [sys.executable, "-m", "wanloom_trainer.launcher", *command]
        proc = subprocess.run(launcher, env={**env, **master}, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"gpu_train_step: the run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(lines[-1].removeprefix("RESULT "))
        if estimate is not None:
            result["estimated_peak_bytes"] = estimate["peak_bytes_per_device"]
            result["estimated_fits"] = estimate["fits"]
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>22}: {value / 2**30:.2f} GiB" if key.endswith("bytes") and value else f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
