"""Fixtures shared across the suite: a real GCS emulator (gcp-storage-emulator) on 127.0.0.1.

Triton decides when it is first imported whether kernels (its own standard library included) are compiled or
interpreted, and many test modules import it indirectly (diffusers, torch): ``TRITON_INTERPRET=1`` is set here,
in the conftest pytest loads first, unless a GPU is present (then the Triton tests run compiled).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helpers shared by test folders (storage_proxy); not packages
GCS_BUCKET = "wanloom-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_gcs() -> ModuleType:
    """.ci/cluster/gcs.py: the emulator `make cluster` runs, patched to behave as GCS does (object generations,
    every bucket a request names exists)."""
    spec = importlib.util.spec_from_file_location(
        "wanloom_ci_gcs", Path(__file__).resolve().parents[1] / ".ci/cluster/gcs.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gcs_emulator = _load_gcs().start

# A test's expected seconds by its marker, for ordering files (below): `slow` means over ~20 s.
_SLOW_S, _OTHER_S = 60, 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in decreasing expected time, tests in their own order within a file: `.ci/test.sh` deals whole files
    to two workers in this order (`--dist loadfile --no-loadscope-reorder`), so the long files start first and the
    short ones fill in at the end (the longest-first rule), instead of one worker running a long file alone."""
    expected: dict[Path, int] = {}
    for item in items:
        expected[item.path] = expected.get(item.path, 0) + (_SLOW_S if item.get_closest_marker("slow") else _OTHER_S)
    items.sort(key=lambda item: -expected[item.path])  # stable: a file's tests keep their order


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """``subprocess.Popen`` in a session of its own; whatever is left of each session when the test ends (a
    trainer, its data process, a spawned child) is killed, so a test that fails or times out leaves nothing
    running behind it."""
    started: list[subprocess.Popen] = []

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen:
        started.append(subprocess.Popen(args, start_new_session=True, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    yield popen
    for process in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """An in-memory gcp-storage-emulator for the whole session; yields its http://127.0.0.1:PORT address."""
    port = free_port()
    server = gcs_emulator("127.0.0.1", port, GCS_BUCKET)
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def gcs(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh gs:// prefix on the emulator; google-cloud-storage, gcsfs and tensorstore all point at it."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs_server)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "wanloom-test")
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:12]}"
