"""Fixtures shared across the suite: a real GCS emulator (gcp-storage-emulator) on 127.0.0.1.

Triton decides when it is first imported whether kernels (its own standard library included) are compiled or
interpreted, and many test modules import it indirectly (diffusers, torch): ``TRITON_INTERPRET=1`` is set here,
in the conftest pytest loads first, unless a GPU is present (then the Triton tests run compiled).
"""

from __future__ import annotations

import os
import shutil

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

import socket
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import pytest

GCS_BUCKET = "wanloom-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_generations() -> None:
    """gcp-storage-emulator with the object generations GCS gives and honours, which tensorstore's OCDBT manifests
    rely on: downloads carry ``x-goog-generation`` (tensorstore reads it back as the manifest's generation and
    writes the next manifest on condition of it) and media uploads with ``ifGenerationMatch`` get 412 on a
    mismatch (0: the object must not exist). Without them a checkpoint now and then failed with "Malformed
    StorageGeneration". Idempotent."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    if getattr(objects, "wanloom_generations", False):
        return
    download, insert = objects.download, objects.insert

    def generation(storage: Any, bucket: str, name: str) -> str:
        try:
            return str(storage.get_file_obj(bucket, name)["generation"])
        except NotFound:
            return "0"

    def download_with_generation(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        found = generation(storage, request.params["bucket_name"], request.params["object_id"])
        if found != "0":
            response["x-goog-generation"] = found
            response["x-goog-metageneration"] = "1"
        return download(request, response, storage, *args, **kwargs)

    def insert_if_generation_matches(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        expected, name = request.query.get("ifGenerationMatch"), request.query.get("name")
        if expected and name and generation(storage, request.params["bucket_name"], name[0]) != expected[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return None
        return insert(request, response, storage, *args, **kwargs)

    replaced = {download: download_with_generation, insert: insert_if_generation_matches}
    objects.download, objects.insert = download_with_generation, insert_if_generation_matches
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            handlers[method] = replaced.get(handler, handler)
    objects.wanloom_generations = True


def gcs_emulator(host: str, port: int, bucket: str) -> Any:
    """A started in-memory GCS emulator on host:port where ``bucket`` exists."""
    from gcp_storage_emulator.server import create_server

    _with_generations()
    server = create_server(host, port, in_memory=True, default_bucket=bucket)
    server.start()
    return server


@pytest.fixture(scope="session")
def start_gcs_emulator() -> Any:
    """``gcs_emulator`` for tests that need one on another address (pods reach the host's, not 127.0.0.1)."""
    return gcs_emulator


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
