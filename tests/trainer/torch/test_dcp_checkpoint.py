"""checkpoint.dcp_checkpoint through TorchBackend (one rank): round trips to a path and to gs:// (emulator),
commit markers, retention, RNG, and an expert that never stepped staying fresh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
from wanloom_trainer.backends.objective import batch_noise
from wanloom_trainer.backends.torch.backend import TorchBackend
from wanloom_trainer.checkpoint.dcp_checkpoint import META_FILE, CheckpointStore, GcsLocation, step_dir_name


def _inputs(step: int, experts: tuple[int, ...]) -> StepInputs:
    rng = np.random.default_rng(step)
    slots = []
    for e in experts:
        rows = RankRows(
            sample_ids=np.array([e, 7]),
            latents=rng.standard_normal((2, 4, 1, 4, 4), dtype=np.float32),
            text=rng.standard_normal((2, 16, 32), dtype=np.float32),
            noise=batch_noise(0, step, [e, 7], (4, 1, 4, 4)),
            timesteps=np.array([950.0, 900.0] if e == 0 else [10.0, 500.0], np.float32),
            weights=np.full(2, 0.25, np.float32),
        )
        slots.append(Slot(e, {0: rows}))
    counts = tuple(2 if e in experts else 0 for e in (0, 1))
    return StepInputs(step, slots, 2 * len(experts), counts, (1e-3, 1e-3))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(state) -> list[dict[str, torch.Tensor]]:
    out = []
    for model, opt in zip(state.experts, state.optimizers, strict=True):
        tensors = {f"p/{n}": _full(p) for n, p in model.named_parameters()}
        for i, s in enumerate(opt.state.values()):
            tensors |= {f"o/{i}/{k}": _full(v) for k, v in s.items()}
        out.append(tensors)
    return out


def _equal(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("where", ["path", "gcs"])
def test_round_trip_restores_experts_optimizers_rng_and_meta(make_config, tmp_path, where, request) -> None:
    uri = str(tmp_path / "ckpt") if where == "path" else request.getfixturevalue("gcs")
    backend = TorchBackend(make_config(training={"checkpoint": {"uri": uri, "keep": 2}}).backend_config)
    state = backend.init_state()
    state, _ = backend.train_step(state, _inputs(0, (0,)))  # the low-noise expert never steps
    backend.save(state, 1, {"data_position": 17})
    torch.manual_seed(1234)
    rng_at_save = torch.get_rng_state()
    backend.save(state, 1, {"data_position": 17})  # overwriting the same step is allowed
    saved = _snapshot(state)

    state, _ = backend.train_step(state, _inputs(1, (0, 1)))
    assert not _equal(_snapshot(state), saved)
    torch.manual_seed(99)
    restored = TorchBackend(make_config(training={"checkpoint": {"uri": uri, "keep": 2}}).backend_config).restore()
    assert (restored.next_step, restored.meta) == (1, {"data_position": 17})
    assert _equal(_snapshot(restored.state), saved)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    low = restored.state.optimizers[1].state.values()
    assert all(float(s["step"]) == 0.0 and not _full(s["exp_avg"]).any() for s in low)  # still fresh


def test_latest_step_skips_incomplete_checkpoints_and_keeps_the_newest(make_config, tmp_path) -> None:
    uri = tmp_path / "ckpt"
    backend = TorchBackend(make_config(training={"checkpoint": {"uri": str(uri), "keep": 2}}).backend_config)
    state = backend.init_state()
    for step in (1, 2, 3):
        backend.save(state, step, {"data_position": step})
    assert sorted(p.name for p in uri.iterdir()) == [step_dir_name(2), step_dir_name(3)]
    (uri / step_dir_name(9)).mkdir()  # a save that died before its meta.json: not a checkpoint
    (uri / f".{step_dir_name(10)}.tmp").mkdir()
    assert backend.restore(state).next_step == 3
    store = CheckpointStore(str(uri), keep=2, staging_dir=tmp_path / "staging")
    assert store.committed_steps() == [2, 3]


def test_gcs_layout_retention_and_clean_staging(make_config, gcs, tmp_path) -> None:
    from google.cloud import storage

    backend = TorchBackend(make_config(training={"checkpoint": {"uri": gcs, "keep": 1}}).backend_config)
    state = backend.init_state()
    backend.save(state, 4, {})
    backend.save(state, 8, {})
    location = GcsLocation.parse(gcs)
    names = [b.name for b in storage.Client().list_blobs(location.bucket, prefix=location.prefix + "/")]
    assert {n.split("/")[-2] for n in names} == {step_dir_name(8)}  # step 4 pruned
    assert any(n.endswith("/" + META_FILE) for n in names) and any(n.endswith(".metadata") for n in names)
    staging = tmp_path / "run" / "checkpoint-staging"
    assert not any(p.is_file() for p in staging.rglob("*"))
    with pytest.raises(ValueError, match="has no bucket"):
        GcsLocation.parse("gs:///x")
