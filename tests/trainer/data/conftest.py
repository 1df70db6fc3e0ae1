"""Fixtures for the data tests: a GCS emulator, a fault-injecting proxy in front of it, tiny encoders and media.

Everything runs offline: the emulator is gcp-storage-emulator on 127.0.0.1, the encoders are random-weight
AutoencoderKLWan / UMT5EncoderModel built and saved here, the media are generated images and one video.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_media beside this file (test dirs are not packages)
from tiny_media import write_tiny_encoders, write_video

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


class FlakyProxy:
    """HTTP proxy in front of the emulator that breaks every ``fail_every``-th object download.

    ``mode`` "503" answers Service Unavailable; "drop" closes the connection without an answer. Counters show how
    many downloads went through and how many were broken.
    """

    def __init__(self, target: str, fail_every: int, mode: str = "503") -> None:
        self.target = target.removeprefix("http://")
        self.fail_every, self.mode = fail_every, mode
        self.downloads = self.injected = 0
        self.down_until = 0.0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def go_down(self, seconds: float) -> None:
        """An outage: every request answers 503 for ``seconds``."""
        self.down_until = time.monotonic() + seconds

    def should_fail(self, method: str, path: str) -> bool:
        if time.monotonic() < self.down_until:
            with self._lock:
                self.injected += 1
            return True
        if method != "GET" or "alt=media" not in path or self.fail_every <= 0:
            return False
        with self._lock:
            self.downloads += 1
            fail = self.downloads % self.fail_every == 0
            self.injected += int(fail)
            return fail

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.should_fail(self.command, self.path):
                    if proxy.mode == "drop" and time.monotonic() >= proxy.down_until:
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(proxy.target, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
