"""Fixtures for the data tests: a GCS emulator, a fault-injecting proxy in front of it, tiny encoders and media.

Everything runs offline: the emulator is gcp-storage-emulator on 127.0.0.1, the encoders are random-weight
AutoencoderKLWan / UMT5EncoderModel built and saved here, the media are generated images and one video.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

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
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def should_fail(self, method: str, path: str) -> bool:
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
                    if proxy.mode == "drop":
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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("tiny-wan")
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.1] * 4, latents_std=[0.5] * 4
    )
    vae.save_pretrained(root / "vae")
    words = [
        "<pad>",
        "</s>",
        "<unk>",
        *[
            "a",
            "an",
            "the",
            "red",
            "blue",
            "green",
            "cat",
            "dog",
            "bird",
            "runs",
            "sits",
            "flies",
            "on",
            "in",
            "grass",
            "sky",
        ],
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(root / "tokenizer")
    config = UMT5Config(vocab_size=len(words), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    return root


@dataclass(frozen=True)
class MediaSet:
    folder: Path
    good: tuple[str, ...]  # sources prepare must encode
    bad: tuple[str, ...]  # sources it must skip


def write_video(path: Path, frames: int, height: int, width: int, fps: int) -> None:
    import av

    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(frames):
            rgb = np.stack([(xx * 3 + i * 8) % 256, (yy * 3) % 256, np.full_like(xx, 40 * (i % 6))], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


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
