"""Experiment tracking of a real tiny run: TensorBoard event files (read back as TFRecords of Event protos) and an
offline W&B run, both holding the step log's numbers; the tensorboard folder beside a gs:// checkpoint root."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3


def read_scalars(folder: Path, images: dict[str, dict[int, bytes]] | None = None) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every event file under ``folder`` (TFRecord: length, crc, Event proto, crc); image
    summaries go into ``images`` (tag -> {step: encoded PNG})."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("image") and images is not None:
                    images.setdefault(value.tag, {})[event.step] = value.image.encoded_image_string
                elif not value.HasField("image"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("tracked")
    doc = yaml.safe_load((ROOT / "jobs/tiny-local.yaml").read_text())
    doc["spec"]["data"]["uri"] = str(workdir / "data")
    doc["spec"]["optimizer"]["warmupSteps"] = 1
    doc["spec"]["training"].update(steps=STEPS, checkpoint={"uri": str(workdir / "ckpt"), "interval": 10})
    doc["spec"]["tracking"] = {"wandb": {"project": "wanloom-test", "mode": "offline"}}
    doc["spec"]["validation"] = {"everySteps": STEPS, "samples": 4}
    (workdir / "job.yaml").write_text(yaml.safe_dump(doc))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "WANDB_SILENT": "true",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")]),
    }
    args = ["run", str(workdir / "job.yaml"), "--no-progress", "--metrics-port", "0", "--run-dir", str(workdir / "run")]
    proc = subprocess.run(
        [sys.executable, "-c", "from wanloom_cli import main; main()", *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir / "run"


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tensorboard_has_every_step_of_the_step_log(tracked_run: Path) -> None:
    images: dict[str, dict[int, bytes]] = {}
    scalars = read_scalars(tracked_run / "tensorboard", images)
    steps = _steps(tracked_run)
    assert len(steps) == STEPS
    for record in steps:
        step = record["step"]
        assert scalars["train/loss"][step] == pytest.approx(record["loss"], rel=1e-6)
        for expert, loss in record["expert_loss"].items():
            assert scalars[f"train/loss/{expert}"][step] == pytest.approx(loss, rel=1e-6)
        assert scalars["perf/step_time_s"][step] == pytest.approx(record["step_time_s"], rel=1e-6)
        assert scalars["train/learning_rate/high_noise"][step] == pytest.approx(
            record["learning_rate"]["high_noise"], rel=1e-6
        )
    (validation,) = (json.loads(line) for line in (tracked_run / "validation.jsonl").read_text().splitlines())
    for expert, loss in validation["losses"].items():  # at the last step it follows
        assert scalars[f"val/loss/{expert}"] == {STEPS - 1: pytest.approx(loss, rel=1e-6)}
    sheet = tracked_run / "samples" / f"step-{STEPS:06d}" / "contact-sheet.png"
    from PIL import Image

    logged = Image.open(io.BytesIO(images["samples/contact-sheet"][STEPS - 1]))
    assert logged.size == Image.open(sheet).size
    (clip,) = sheet.parent.glob("sample-*.mp4")
    gif = Image.open(io.BytesIO(images[f"samples/{clip.stem}"][STEPS - 1]))
    assert gif.format == "GIF" and gif.n_frames >= 1


def read_wandb_history(path: Path) -> dict[int, dict[str, float]]:
    """step -> logged values from an offline run's ``.wandb`` file: a 7-byte header, then records in 32 KiB blocks
    (each piece: crc32 u32, length u16, type u8 full/first/middle/last) holding ``wandb_internal_pb2.Record``s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, offset, pending = path.read_bytes(), 32768, 7, b""
    history: dict[int, dict[str, float]] = {}
    while offset < len(data):
        left = block - offset % block
        if left < 7:  # a block's tail too short for a header is padding
            offset += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                values = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = values
    return history


@pytest.mark.slow
def test_offline_wandb_run_holds_every_step(tracked_run: Path) -> None:
    runs = sorted((tracked_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tracked_run / "wandb").iterdir())
    history = read_wandb_history(next(runs[0].glob("*.wandb")))
    for record in _steps(tracked_run):
        values = history[record["step"]]
        assert values["train/loss"] == pytest.approx(record["loss"], rel=1e-6)
        assert values["train/loss/low_noise"] == pytest.approx(record["expert_loss"]["low_noise"], rel=1e-6)


def test_tensorboard_goes_beside_a_gcs_checkpoint_root(tmp_path: Path) -> None:
    from wanloom_api.trainingjob import TrackingSpec
    from wanloom_trainer.config.train_config import TrackingConfig
    from wanloom_trainer.tracking import tensorboard_dir

    def config(checkpoint: str | None, uri: str | None = None) -> TrackingConfig:
        spec = TrackingSpec.model_validate({"tensorboardUri": uri})
        return TrackingConfig(spec, "job", None, "/runs/job", checkpoint, {})

    assert tensorboard_dir(config("gs://bucket/team/job/checkpoints")) == "gs://bucket/team/job/tensorboard"
    assert tensorboard_dir(config("gs://bucket/")) == "gs://bucket/tensorboard"
    assert tensorboard_dir(config("/data/ckpt")) == "/runs/job/tensorboard"
    assert tensorboard_dir(config(None)) == "/runs/job/tensorboard"
    assert tensorboard_dir(config("gs://bucket/ckpt", "gs://other/tb")) == "gs://other/tb"


def test_tensorboard_on_a_bucket_that_stops_answering_never_holds_up_the_run(
    gcs: str, gcs_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """While the bucket is away the run's calls return at once and closing gives up after its timeout, naming the
    staging folder that holds every event; once the bucket is back a run's close copies them all. Before:
    tensorboardX's own gs:// writer blocked add_scalar once its 10-event queue filled behind a stalled upload, and
    its finalizer hung the process at exit."""
    import threading

    from storage_proxy import FlakyProxy

    from wanloom_trainer.data.storage import open_storage
    from wanloom_trainer.tracking import tensorboard

    proxy = FlakyProxy(gcs_server, fail_every=0, mode="drop")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.address)
    proxy.go_down(600)
    try:
        tracker = tensorboard.TensorBoardTracker(f"{gcs}/away", 0, flush_seconds=0.2)
        steps = threading.Thread(target=lambda: [tracker.scalars(s, {"train/loss": float(s)}) for s in range(300)])
        steps.start()
        steps.join(30)
        assert not steps.is_alive(), "the run's thread is blocked in the tracker"
        closed = threading.Thread(target=tracker.close, kwargs={"timeout_s": 1.0})
        closed.start()
        closed.join(30)
        assert not closed.is_alive(), "closing waits for the bucket"
        staged = read_scalars(tracker.local)["train/loss"]
        print(f"injected: bucket away; found: 300 steps returned, {len(staged)} staged in {tracker.local}")
        assert staged == {s: float(s) for s in range(300)}

        proxy.go_down(1.0)  # back after a second: the periodic copies fail, then one lands
        tracker = tensorboard.TensorBoardTracker(f"{gcs}/back", 0, flush_seconds=0.2)
        tracker.scalars(7, {"train/loss": 7.0})
        tracker.close(timeout_s=60)
        bucket = open_storage(f"{gcs}/back")
        for name in bucket.list():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(bucket.read(name))
        assert read_scalars(tmp_path)["train/loss"] == {7: 7.0}
        assert not tracker.local.exists(), "the staging folder is removed once its events are copied"
    finally:
        proxy.close()


def test_the_tensorboard_threads_parse_no_source(gcs: str) -> None:
    """The tracker's threads (tensorboardX's writer, the copy to gs://) must not parse Python source while the run's
    thread may (W&B's pydantic models do at import): CPython before 3.11.8 (CI has 3.11.7) counts AST depth per
    interpreter, and two parses at once fail with "SystemError: AST constructor recursion depth mismatch" (a CI run
    hit it). tensorboardX imports torch, which parses source; so may a library a thread imports on first use."""
    script = f"""
import ast, builtins, threading
parsed_on = set()
compile_ = builtins.compile
def spy(source, filename, mode, flags=0, *args, **kwargs):
    if flags & ast.PyCF_ONLY_AST:
        parsed_on.add(threading.current_thread().name)
    return compile_(source, filename, mode, flags, *args, **kwargs)
builtins.compile = spy
from wanloom_trainer.tracking.tensorboard import TensorBoardTracker
tracker = TensorBoardTracker({gcs + "/tb"!r}, 0, flush_seconds=0.1)
tracker.scalars(0, {{"train/loss": 1.0}})
tracker.close()
print(sorted(parsed_on), sorted(tracker._copier.copied))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    print(f"threads that parsed source, files copied: {proc.stdout.strip()}")
    assert proc.stdout.startswith("['MainThread'] ['events.out.tfevents.")
