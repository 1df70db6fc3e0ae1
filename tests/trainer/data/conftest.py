"""Fixtures for the data tests: a GCS emulator, a fault-injecting proxy in front of it, tiny encoders and media.

Everything runs offline: the emulator is gcp-storage-emulator on 127.0.0.1, the encoders are random-weight
AutoencoderKLWan / UMT5EncoderModel built and saved here, the media are generated images and one video.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_media beside this file (test dirs are not packages)
from storage_proxy import FlakyProxy
from tiny_media import write_tiny_encoders, write_video


@pytest.fixture
def flaky_gcs(gcs: str, gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FlakyProxy]]:
    """(gs:// prefix, proxy): clients reach the emulator through the proxy; failures start disabled (fail_every=0)."""
    proxy = FlakyProxy(gcs_server, fail_every=0)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.address)
    yield gcs, proxy
    proxy.close()


# --- tiny encoders and media for `prepare` --------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers-layout root (vae/, text_encoder/, tokenizer/) with random weights sized for the tiny variant."""
    return write_tiny_encoders(tmp_path_factory.mktemp("tiny-wan"))


@dataclass(frozen=True)
class MediaSet:
    folder: Path
    good: tuple[str, ...]  # sources prepare must encode
    bad: tuple[str, ...]  # sources it must skip


@pytest.fixture
def video_writer():  # type: ignore[no-untyped-def]
    """``write_video(path, frames, height, width, fps)``: a small moving-gradient MPEG-4 clip."""
    return write_video


@pytest.fixture(scope="session")
def media_set(tmp_path_factory: pytest.TempPathFactory) -> MediaSet:
    """Three images (landscape, portrait, square), one 20-frame video, one corrupt image; all captioned."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    captions = {
        "a.png": "a red cat sits on the grass",
        "b.jpg": "a blue bird flies in the sky",
        "sub/c.png": "the green dog runs",
        "clip.mp4": "a dog runs on the grass",
        "broken.png": "a cat",
    }
    (folder / "sub").mkdir()
    for name, (h, w) in {"a.png": (60, 90), "b.jpg": (100, 70), "sub/c.png": (64, 64)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
    write_video(folder / "clip.mp4", frames=20, height=72, width=88, fps=16)
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    for name, text in captions.items():
        (folder / name).with_suffix(".txt").write_text(text)
    return MediaSet(folder, ("a.png", "b.jpg", "clip.mp4", "sub/c.png"), ("broken.png",))


@pytest.fixture
def corpus(gcs: str, media_set, video_writer, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    """The media set in a bucket, plus a 3 s clip at 16 fps, under a JSONL manifest that cuts two clips from it."""
    from wanloom_trainer.data.storage import open_storage

    storage = open_storage(gcs)
    for name in ("a.png", "b.jpg", "sub/c.png", "clip.mp4", "broken.png"):
        storage.upload(f"media/{name}", media_set.folder / name)
    video_writer(tmp_path / "long.mp4", frames=48, height=72, width=88, fps=16)
    storage.upload("media/long.mp4", tmp_path / "long.mp4")
    storage.write("captions/b.txt", b"a blue bird flies in the sky\n")
    rows = [
        {"path": "media/a.png", "caption": "a red cat sits on the grass", "id": "cat"},
        {"path": "media/b.jpg", "caption_path": "captions/b.txt"},
        {"path": f"{gcs}/media/clip.mp4", "caption": "a dog runs on the grass"},
        {"path": "media/broken.png", "caption": "a cat"},
        {"path": "media/long.mp4", "caption": "the first second", "start": 0.0, "end": 1.0},
        {"path": "media/long.mp4", "caption": "from 1.5 s on", "start": 1.5},
        {"path": "media/sub/c.png", "caption": "the green dog runs"},
        {"path": "media/missing.png", "caption": "not there"},
    ]
    storage.write("corpus/manifest.jsonl", "\n".join(json.dumps(r) for r in rows).encode())
    # The manifest's relative paths are relative to its own folder.
    for name in ("media", "captions"):
        for obj in storage.list(name):
            storage.write(f"corpus/{obj}", storage.read(obj))
    return f"{gcs}/corpus/manifest.jsonl"
