"""checkpoint.dcp_checkpoint through TorchBackend (one rank): round trips to a path and to gs:// (emulator),
commit markers, retention, RNG, and an expert that never stepped staying fresh."""

from __future__ import annotations

import time
from pathlib import Path

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


def _save_with_rank1_upload_failing(rank: int, init: str, uri: str, staging: str, out: str) -> None:
    """One rank of a two-rank gloo group saving a gs:// checkpoint whose upload fails on rank 1 alone."""
    import torch.distributed as dist

    from wanloom_trainer.checkpoint import dcp_checkpoint

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:

        def refused(*_args: object, **_kwargs: object) -> None:
            raise ConnectionError("storage refused the upload")

        dcp_checkpoint.upload_dir = refused
    store = CheckpointStore(uri, keep=2, staging_dir=staging)
    try:
        store.save({"w": torch.full((4,), float(rank))}, 10, {})
        outcome = "saved"
    except ConnectionError as exc:
        outcome = f"ConnectionError: {exc}"
    Path(f"{out}.{rank}").write_text(outcome)
    dist.barrier()  # both ranks reach the same next collective: nobody was left inside the save
    dist.destroy_process_group()


def test_an_upload_failing_on_one_rank_fails_the_save_on_every_rank_without_a_hang(gcs, tmp_path) -> None:
    """Rank 1's upload fails, rank 0's succeeds: rank 0 used to wait for rank 1 in the save's barrier while rank 1
    left the save. Both now raise (the trainer drops the save and makes it again) and nothing is committed."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "outcome")
    context = mp.start_processes(
        _save_with_rank1_upload_failing, args=(init, gcs, str(tmp_path / "staging"), out), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, "a rank is still inside the save after 120 s"
    finally:
        for process in context.processes:
            process.kill()
    outcomes = [Path(f"{out}.{rank}").read_text() for rank in (0, 1)]
    assert outcomes == ["ConnectionError: rank 1 could not write " + gcs + "/step_00000010",
                        "ConnectionError: storage refused the upload"], outcomes  # fmt: skip
    assert CheckpointStore(gcs, keep=2, staging_dir=tmp_path / "check").committed_steps() == []
