"""The trainer's step against a minimal hand-written loop doing the same work, both backends, side by side.

The tiny two-expert job (`jobs/tiny-local.yaml`: same plans, shapes, routing, noise and optimizer) runs through
``wanloom_trainer.train.run`` with a recording wrapper around its backend, which keeps every step's inputs (the
host arrays the backend receives) and times ``train_step``. After each trainer step a minimal loop replays that
step's inputs with everything a hand-written loop needs and nothing else: the same model and loss functions, the
same AdamW moments, one ``device_put`` per slot (JAX, parameters as a flat list across ``jit``) or plain tensors
(PyTorch, no FSDP), no planning, loading, metrics or checkpoints. Pairing each trainer step with a minimal step a
moment later lets both see the same machine speed (it drifts by tens of percent within seconds on a shared
host); the ratio is the median over steps of trainer step / minimal step (compilation spikes are a few steps of
many). A trainer step is the wall time between its consecutive steps, less the minimal step in between.

Breakdown of the trainer's step (medians): ``backend`` (``train_step``), split into ``slots`` (each slot's
host→device, forward and backward, as the backend times them for the step-time metrics) and ``update`` (the rest of
``train_step``: the optimizer, gradient clipping, the loss totals and, on several ranks, their collectives);
``data_wait`` (receiving the step's plan and rows from the data process, where planning and loading run);
``driver`` (the rest: routing the rows into slots, metrics, the step log, the per-step gather, checkpoint
bookkeeping).

The loader (``loader``): the trainer's path (``PlanPrefetcher`` at the job's prefetch depth, one sample per
micro-batch: byte-range read, CRC-32, ``.npy`` parsing, shape and finiteness checks, float32 rows) against plain
``webdataset`` iterating the very same shards and decoding the same arrays, interleaved, samples/s.

XLA's CPU fast-compile flags (``compile``, with ``--compile``): the tiny job run by ``wanloom run`` with the flags
and with XLA's defaults, each from an empty compilation cache; compile cost = the steps' total time − steps ×
median step, and the crossover run length (steps) beyond which the defaults win
(``distributed_jax.FAST_COMPILE_MAX_STEPS``).

Usage (``--json`` prints one object; writes benchmarks/results/step_overhead.json):

    PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/step_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tiny_job import tiny_config

from wanloom_trainer.train.run import make_backend, run

OUT = Path(__file__).parent / "results" / "step_overhead.json"


class Recording:
    """The job's real backend, with ``train_step`` timed and each step's inputs kept for the minimal loop."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.inputs: list[Any] = []
        self.step_s: list[float] = []
        self.slots_s: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def train_step(self, state: Any, inputs: Any) -> Any:
        started = time.perf_counter()
        out = self._backend.train_step(state, inputs)
        self.step_s.append(time.perf_counter() - started)
        self.slots_s.append(out[1].busy_seconds)
        self.inputs.append(inputs)
        return out


def _background_cpu_s() -> float:
    """CPU seconds used so far by this process's other threads and by its child processes (the trainer's data
    process), from Linux's per-thread schedstat (nanoseconds)."""
    me, total, pids = threading.get_native_id(), 0, [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                if pid == os.getpid() and int(task.name) == me:
                    continue
                total += int((task / "schedstat").read_text().split()[0])
                pids.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):  # a thread or process that just ended
            continue
    return total / 1e9


def _wait_for_background(quiet_s: float = 0.002, limit_s: float = 1.0) -> None:
    """Until the trainer's background work (loading, planning, XLA's pool; in this process or its data process)
    uses no CPU for ``quiet_s``: the minimal step must not share the machine with it, nor hide it (loading is
    bounded by the prefetch depth, so a pause never lets the trainer's next step do less of it)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        before = _background_cpu_s()
        time.sleep(quiet_s)
        if _background_cpu_s() - before < quiet_s / 20:
            return


def paired_round(backend_name: str, steps: int) -> dict[str, Any]:
    """One trainer run with a minimal step after each of its steps, on that step's very inputs: each pair runs
    within a tenth of a second, so the machine's speed (which drifts by tens of percent within seconds on a
    shared host) is the same for both. The minimal step runs outside the trainer's step time."""
    with tempfile.TemporaryDirectory() as workdir:
        config = tiny_config(
            workdir, training={"steps": steps, "checkpoint": {"uri": None}}, resources={"backend": backend_name}
        )
        backend = Recording(make_backend(config))
        minimal_step = MINIMAL[backend_name](config)
        trainer_s: list[float] = []
        minimal_s: list[float] = []
        resumed = [time.perf_counter()]

        def on_step(_: Any) -> None:
            trainer_s.append(time.perf_counter() - resumed[0])
            _wait_for_background()
            started = time.perf_counter()
            minimal_step(backend.inputs[-1])
            minimal_s.append(time.perf_counter() - started)
            resumed[0] = time.perf_counter()

        result = run(config, backend=backend, progress=False, on_step=on_step)
    # The first step of each run compiles (JAX) or warms up; steps that compile a new shape are a few of many.
    trainer, minimal = np.asarray(trainer_s[1:]), np.asarray(minimal_s[1:])
    data_wait = np.asarray([r.data_wait_s for r in result.records[1:]])
    step, slots = np.asarray(backend.step_s[1:]), np.asarray(backend.slots_s[1:])
    return {
        "ratios": trainer / minimal,
        "trainer_s": trainer,
        "minimal_s": minimal,
        "backend_s": step,
        "slots_s": slots,
        "update_s": step - slots,
        "data_wait_s": data_wait,
        "driver_s": trainer - step - data_wait,
    }


# -- the minimal loops: the same model, loss and optimizer, one step per call ------------------------------------


def minimal_torch(config: Any) -> Any:
    import torch

    from wanloom_trainer.backends.torch.backend import expert_seed
    from wanloom_trainer.backends.torch.step import flow_matching_loss, make_adamw, rows_to_tensors, update
    from wanloom_trainer.model.wan_torch import build_expert

    models = [build_expert(config.model.wan, seed=expert_seed(config.seed, e)) for e in range(2)]
    optimizers = [make_adamw(m.parameters(), config.optimizer) for m in models]
    device = torch.device("cpu")

    def step(inputs: Any) -> None:
        for slot in inputs.slots:
            batch = rows_to_tensors(slot.ranks[0], device)
            loss, _ = flow_matching_loss(models[slot.expert], **batch, compute_dtype=torch.float32)
            loss.backward()
        for e, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            if inputs.expert_samples[e]:
                update(model, optimizer, inputs.learning_rates[e], config.optimizer.clip_grad_norm)

    return step


def _host_batch(rows: Any) -> tuple[dict[str, np.ndarray], int]:
    """One rank's rows as the arrays the step reads, rows padded to a power of two (the trainer's programs)."""
    from wanloom_trainer.backends.packing import PackedRows

    if isinstance(rows, PackedRows):
        keys = ("latents", "noise", "condition", "positions", "segment_ids", "text", "timesteps", "weights",
                "clean_first_frame")  # fmt: skip
        arrays, max_segment = (
            {k: getattr(rows, k) for k in keys if getattr(rows, k) is not None},
            rows.max_segment_tokens,
        )
    else:
        keys = ("latents", "text", "noise", "timesteps", "weights", "condition", "clean_first_frame")
        arrays, max_segment = {k: getattr(rows, k) for k in keys if getattr(rows, k) is not None}, 0
    n = len(arrays["weights"])
    target = 1 << max(0, n - 1).bit_length()
    if target != n:
        arrays = {
            k: np.concatenate([v, np.repeat(np.zeros_like(v[:1]) if k == "weights" else v[:1], target - n, axis=0)])
            for k, v in arrays.items()
        }
    return arrays, max_segment


def minimal_jax(config: Any) -> Any:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from wanloom_trainer.backends.jax.step import flow_matching_loss, moment_transform, packed_flow_matching_loss
    from wanloom_trainer.model.wan_jax import init_model

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    m = config.model
    kwargs = {"param_dtype": dtype[m.param_dtype], "compute_dtype": dtype[m.compute_dtype], "adaln_impl": m.adaln,
              "attention_impl": "xla", "remat": "none"}  # fmt: skip
    graphdef, treedef, experts = None, None, []
    for e in range(2):
        graphdef, params = nnx.split(init_model(m.wan, seed=e, **kwargs), nnx.Param)
        leaves, treedef = jax.tree.flatten(params)
        experts.append(leaves)
    tx = moment_transform(config.optimizer)
    opt = [tx.init(leaves) for leaves in experts]

    def loss(leaves: list[Any], batch: dict[str, Any], max_segment: int) -> jax.Array:
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        if "segment_ids" in batch:
            return packed_flow_matching_loss(model, batch, max_segment)
        return flow_matching_loss(model, batch)

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnums=(3,))
    def accumulate(leaves: list[Any], grads: list[Any], batch: dict[str, Any], max_segment: int) -> Any:
        (value, _), g = jax.value_and_grad(loss, has_aux=True)(leaves, batch, max_segment)
        return [a + b for a, b in zip(grads, g, strict=True)], value

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def update(leaves: list[Any], state: Any, grads: list[Any], lr: jax.Array) -> Any:
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        if config.optimizer.clip_grad_norm is not None:
            factor = jnp.minimum(1.0, config.optimizer.clip_grad_norm / norm)
            grads = [g * factor for g in grads]
        updates, state = tx.update(grads, state, leaves)
        return [p - lr * u for p, u in zip(leaves, updates, strict=True)], state, norm

    def step(inputs: Any) -> None:
        grads: list[Any] = [None, None]
        losses = []
        for slot in inputs.slots:
            e = slot.expert
            if grads[e] is None:
                grads[e] = [jnp.zeros_like(p) for p in experts[e]]
            arrays, max_segment = _host_batch(slot.ranks[0])
            grads[e], value = accumulate(experts[e], grads[e], jax.device_put(arrays), max_segment)
            losses.append(value)
        for e in range(2):
            if inputs.expert_samples[e]:
                experts[e], opt[e], _ = update(experts[e], opt[e], grads[e], jnp.float32(inputs.learning_rates[e]))
        float(sum(losses))  # the step's loss on the host, as any loop logs it
        jax.block_until_ready(experts)

    return step


MINIMAL = {"torch": minimal_torch, "jax": minimal_jax}


# -- the loader against plain webdataset -------------------------------------------------------------------------


def loader_compare(rounds: int, passes: int = 20) -> dict[str, Any]:
    import webdataset as wds

    from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan
    from wanloom_trainer.data import ensure_synthetic, open_dataset
    from wanloom_trainer.data.prefetch import PlanPrefetcher

    with tempfile.TemporaryDirectory() as workdir:
        config = tiny_config(workdir)
        ensure_synthetic(config.data, config.model.wan, progress=False)
        dataset = open_dataset(config.data.uri, config.data.index, max_bad_samples=0)
        n, shapes = dataset.num_samples, dataset.latent_shapes
        shards = [dataset.storage.join(s) for s in dataset.index.shards]
        # ``passes`` passes over the dataset per measurement, so one lasts long enough to time (the tiny job's
        # samples take tens of microseconds each).
        plans = [
            StepPlan(s, (RankPlan((MicroBatch((i,), tuple(int(v) for v in shapes[i]), 0, (1.0,), (1.0,)),), 0.0),), 1)
            for s, i in enumerate(i for _ in range(passes) for i in range(n))
        ]

        def ours() -> float:
            start = time.perf_counter()
            with PlanPrefetcher(dataset, plans, rank=0, depth=config.data.prefetch) as prefetcher:
                rows = sum(mb.batch.size for step in prefetcher for mb in step)
            assert rows == n * passes
            return rows / (time.perf_counter() - start)

        def direct() -> float:  # the same loads in this thread: the loader without the prefetch hand-off
            start = time.perf_counter()
            for plan in plans:
                mb = plan.ranks[0].micro_batches[0]
                dataset.load(mb.sample_ids, mb.latent_shape)
            return len(plans) / (time.perf_counter() - start)

        def plain() -> float:
            start = time.perf_counter()
            rows = 0
            for _ in range(passes):
                for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode():
                    for key in ("latents.npy", "text.npy"):
                        np.asarray(sample[key], dtype=np.float32)
                    rows += 1
            assert rows == n * passes
            return rows / (time.perf_counter() - start)

        ours(), plain()  # warm the page cache and imports
        triples = [(ours(), direct(), plain()) for _ in range(rounds)]
        dataset.close()
    ratios = [a / c for a, _, c in triples]
    return {
        "ratio_vs_webdataset": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "direct_ratio_vs_webdataset": statistics.median(b / c for _, b, c in triples),
        "loader_samples_per_s": statistics.median(a for a, _, _ in triples),
        "direct_samples_per_s": statistics.median(b for _, b, _ in triples),
        "webdataset_samples_per_s": statistics.median(c for _, _, c in triples),
        "samples": n,
        "passes": passes,
        "rounds": rounds,
    }


# -- XLA's fast-compile flags against its defaults ---------------------------------------------------------------

XLA_SETTINGS = {
    "fast-compile": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    "default": "--xla_backend_optimization_level=3 --xla_llvm_disable_expensive_passes=false",
}


def _cli_run(xla_flags: str, steps: int) -> tuple[float, float]:
    """(total step time, median step time) of a fresh `wanloom run` of the tiny job, compiling from scratch."""
    from wanloom_trainer.metrics.records import StepLog

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as workdir:
        env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_COMPILATION_CACHE_DIR=str(Path(workdir) / "jax-cache"))
        job = Path(workdir) / "job.yaml"
        job.write_text((root / "jobs" / "tiny-local.yaml").read_text())
        cli = [sys.executable, "-c", "from wanloom_cli import main; main()"]
        subprocess.run([*cli, "run", str(job), "--steps", str(steps), "--metrics-port", "0", "--no-progress"],
                       cwd=workdir, env=env, check=True, capture_output=True)  # fmt: skip
        lines = (Path(workdir) / "runs" / "tiny-local" / "steps.jsonl").read_text().splitlines()
        times = [StepLog.from_json(line).step_time_s for line in lines]
    return sum(times), statistics.median(times)


def compile_compare(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": steps}
    for name, flags in XLA_SETTINGS.items():
        total, step = _cli_run(flags, steps)
        out[name] = {"step_s": step, "compile_s": total - steps * step}
    fast, default = out["fast-compile"], out["default"]
    saved_per_step = fast["step_s"] - default["step_s"]
    extra_compile = default["compile_s"] - fast["compile_s"]
    out["crossover_steps"] = extra_compile / saved_per_step if saved_per_step > 0 else None
    return out


def compare(backend: str, steps: int, rounds: int) -> dict[str, Any]:
    paired = [paired_round(backend, steps) for _ in range(rounds)]
    per_round = [float(np.median(p["ratios"])) for p in paired]

    def median(key: str) -> float:
        return float(np.median(np.concatenate([p[key] for p in paired])))

    return {
        "ratio": median("ratios"),
        "ratio_round_min": min(per_round),
        "ratio_round_max": max(per_round),
        "ratio_p25": float(np.percentile(np.concatenate([p["ratios"] for p in paired]), 25)),
        "ratio_p75": float(np.percentile(np.concatenate([p["ratios"] for p in paired]), 75)),
        "trainer_step_s": median("trainer_s"),
        "minimal_step_s": median("minimal_s"),
        "breakdown_s": {k: median(k) for k in ("backend_s", "slots_s", "update_s", "data_wait_s", "driver_s")},
        "rounds": rounds,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--loader-rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also measure XLA's fast-compile flags (minutes)")
    parser.add_argument("--compile-steps", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {b: compare(b, args.steps, args.rounds) for b in args.backends.split(",") if b}
    results["loader"] = loader_compare(args.loader_rounds)
    if args.compile:
        results["compile"] = compile_compare(args.compile_steps)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    if args.json:
        print(json.dumps(results))
        return
    for backend in args.backends.split(","):
        if not backend:
            continue
        r = results[backend]
        parts = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms" for k, v in r["breakdown_s"].items())
        spread = (
            f"steps p25-p75 {r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}, "
            f"rounds {r['ratio_round_min']:.2f}-{r['ratio_round_max']:.2f}"
        )
        print(
            f"{backend}: trainer {r['trainer_step_s'] * 1e3:.1f} ms/step vs minimal loop "
            f"{r['minimal_step_s'] * 1e3:.1f} ms/step: {r['ratio']:.2f}x ({spread}); trainer: {parts}"
        )

    loader = results["loader"]
    print(
        f"loader: {loader['loader_samples_per_s']:.0f} samples/s vs plain webdataset "
        f"{loader['webdataset_samples_per_s']:.0f}: {loader['ratio_vs_webdataset']:.2f}x "
        f"(rounds {loader['ratio_min']:.2f}-{loader['ratio_max']:.2f}); loading in the calling thread "
        f"{loader['direct_ratio_vs_webdataset']:.2f}x"
    )
    if "compile" in results:
        c = results["compile"]
        for name in XLA_SETTINGS:
            print(f"XLA {name}: compile {c[name]['compile_s']:.1f} s, step {c[name]['step_s'] * 1e3:.1f} ms")
        print(f"the defaults win beyond {c['crossover_steps']} steps")


if __name__ == "__main__":
    main()
