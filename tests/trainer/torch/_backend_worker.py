"""A trainer process for the multi-process and kill-and-resume tests (run as a script, one per rank).

It drives ``TorchBackend`` through a fixed, deterministic per-rank plan (``step_inputs``): three micro-batch slots
over two data-parallel ranks with unequal shapes, a dummy micro-batch on each rank, a zero-weight padding row, and
every third step routed to the high-noise expert only (the low-noise expert must then stay untouched). With one
data-parallel rank the same rows run as four slots on that rank, which must give the same step. Every token count
is even (context parallelism of degree 2 splits each row's sequence). The rows follow the job's variant: image
condition channels for I2V, and for a unified TI2V model every other video row trained as image-to-video (per-token
timesteps); a one-model variant runs every slot through its one expert.

Usage: python _backend_worker.py OUT_DIR --steps N [--save-at K] [--crash-at S] [--resume]
Environment: WANLOOM_CONFIG and the wanloom process variables (see config.train_config).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch

from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
from wanloom_trainer.backends.objective import batch_noise
from wanloom_trainer.backends.torch.backend import TorchBackend
from wanloom_trainer.config.train_config import load_train_config
from wanloom_trainer.config.variants import WanVariant

TEXT_LEN, TEXT_DIM, SEED = 16, 32, 0


def _rows(
    variant: WanVariant, step: int, ids: list[int], shape: tuple[int, int, int], expert: int, real: int
) -> RankRows:
    """Rows for sample ``ids`` (the first ``real`` carry weight 1/5, the rest are padding)."""
    rng = np.random.default_rng([step, *ids, 77])
    b, channels = len(ids), variant.latent_channels
    t = [(900.0 + 7 * i) if expert == 0 else (100.0 + 31 * i) for i in ids]
    condition = clean = None
    if variant.condition_channels:
        condition = rng.standard_normal((b, variant.condition_channels, *shape), dtype=np.float32)
    if variant.per_token_timesteps:
        clean = np.asarray([float(shape[0] > 1 and i % 2 == 0) for i in ids], np.float32)
    return RankRows(
        sample_ids=np.asarray(ids, np.int64),
        latents=rng.standard_normal((b, channels, *shape), dtype=np.float32),
        text=rng.standard_normal((b, TEXT_LEN, TEXT_DIM), dtype=np.float32),
        noise=batch_noise(SEED, step, ids, (channels, *shape)) if ids else np.zeros((0, channels, *shape), np.float32),
        timesteps=np.asarray(t, np.float32),
        weights=np.asarray([0.2] * real + [0.0] * (b - real), np.float32),
        condition=condition,
        clean_first_frame=clean,
    )


def _dummy(variant: WanVariant, shape: tuple[int, int, int]) -> RankRows:
    return _rows(variant, 0, [], shape, 0, 0)


def two_rank_plan(variant: WanVariant, step: int) -> list[tuple[int, RankRows, RankRows]]:
    """(expert, rank-0 rows, rank-1 rows) per slot; 5 real samples in all."""
    low = 1 if variant.two_experts else 0
    slots = [(0, _rows(variant, step, [0, 1], (2, 4, 4), 0, 2), _rows(variant, step, [2], (1, 6, 4), 0, 1))]
    if step % 3 == 1:  # high-noise only: the low-noise expert takes no step
        slots.append((0, _rows(variant, step, [3], (2, 4, 4), 0, 1), _dummy(variant, (1, 4, 4))))
        slots.append((0, _dummy(variant, (1, 4, 4)), _rows(variant, step, [4, 4], (1, 4, 6), 0, 1)))
    else:
        slots.append((low, _rows(variant, step, [3], (2, 4, 4), 1, 1), _dummy(variant, (1, 4, 4))))
        slots.append((low, _dummy(variant, (1, 4, 4)), _rows(variant, step, [4, 4], (1, 4, 6), 1, 1)))
    return slots


def step_inputs(variant: WanVariant, step: int, dp_size: int) -> StepInputs:
    plan = two_rank_plan(variant, step)
    if dp_size == 2:
        slots = [Slot(e, {0: r0, 1: r1}) for e, r0, r1 in plan]
    else:  # one rank runs every non-empty micro-batch itself
        slots = [Slot(e, {0: rows}) for e, r0, r1 in plan for rows in (r0, r1) if rows.rows]
    lr = 1e-3 * (1 + step % 2)
    if not variant.two_experts:
        return StepInputs(step, slots, 5, (5,), (lr,))
    high = 3 + (2 if step % 3 == 1 else 0)
    return StepInputs(step, slots, 5, (high, 5 - high), (lr, 0.5 * lr))


def full_parameters(backend: TorchBackend, state) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for name, model in zip(backend.names, state.experts, strict=True):
        for key, value in get_model_state_dict(model, options=options).items():
            out[f"{name}/{key}"] = value.float().numpy()
    return out


def layout(backend: TorchBackend, state) -> dict:
    """How the run is really sharded: the context degree diffusers applied (0: none) and the share of every
    expert's parameter elements this rank holds (FSDP2 shards are DTensors)."""
    from torch.distributed.tensor import DTensor

    model = state.experts[0]
    config = getattr(model, "_parallel_config", None)
    cp = config.context_parallel_config.ulysses_degree if config is not None else 0
    params = list(model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return {"context": cp, "parameter_share": local / sum(p.numel() for p in params)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    backend = TorchBackend(load_train_config(os.environ).backend_config)
    state, first = backend.init_state(), 0
    if args.resume:
        restored = backend.restore(state)
        state, first = restored.state, restored.next_step
        assert restored.meta == {"data_position": first}, restored.meta
    (args.out / f"layout-rank{backend.process_index}.json").write_text(json.dumps(layout(backend, state)))
    log = args.out / f"losses-rank{backend.process_index}.jsonl"
    for step in range(first, args.steps):
        inputs = step_inputs(backend.config.model.wan, step, backend.dp_size)
        if step == args.crash_at:  # die mid-step, after one micro-batch's backward
            from wanloom_trainer.backends.torch.step import accumulate

            accumulate(state.experts[inputs.slots[0].expert], inputs.slots[0].ranks[backend.dp_rank], backend.device,
                       torch.float32)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        state, out = backend.train_step(state, inputs)
        record = {"step": step, "loss": [e.loss_sum for e in out.experts], "norm": [e.grad_norm for e in out.experts]}
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if args.save_at is not None and step + 1 == args.save_at:
            backend.save(state, step + 1, {"data_position": step + 1})
    params = full_parameters(backend, state)
    if backend.process_index == 0:
        np.savez(args.out / "params.npz", **params)
    backend.close()


if __name__ == "__main__":
    main()
