"""A GCS emulator (gcp-storage-emulator, in memory) that behaves as GCS does where our clients depend on it.

- Downloads carry ``x-goog-generation`` and media and multipart uploads with ``ifGenerationMatch`` get 412 on a
  mismatch (0: the object must not exist). tensorstore reads the generation back as an OCDBT manifest's and writes
  the next manifest on condition of it; without them a checkpoint now and then failed with "Malformed
  StorageGeneration".
- Every bucket a request names exists (made on first use), so a TrainingJob can name any bucket, as a real
  project's buckets exist before a job runs.

`make cluster` runs it on the host's address, where the real node's pods reach it (``up.py``:
``python gcs.py HOST PORT``); the test suite starts its own on 127.0.0.1 (tests/conftest.py).
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Any


def patch() -> None:
    """Patch gcp-storage-emulator's object handlers (idempotent)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import buckets, objects

    if getattr(objects, "wanloom_patched", False):
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
        if expected and not name and request.query.get("uploadType") == ["multipart"]:
            name = [request.data["meta"].get("name")]  # a multipart upload names its object in its metadata part
        if expected and name and generation(storage, request.params["bucket_name"], name[0]) != expected[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return None
        return insert(request, response, storage, *args, **kwargs)

    def with_its_bucket(handler: Any) -> Any:
        """``handler``, after creating the bucket the request names if it is missing (gcsfs and orbax look the
        bucket up before they write)."""

        def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            bucket = request.params.get("bucket_name")
            if bucket and not storage.get_bucket(bucket):
                buckets.create_bucket(bucket, storage)
            return handler(request, response, storage, *args, **kwargs)

        return handle

    replaced = {download: download_with_generation, insert: insert_if_generation_matches}
    objects.download, objects.insert = download_with_generation, insert_if_generation_matches
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            handlers[method] = with_its_bucket(replaced.get(handler, handler))
    objects.wanloom_patched = True


def start(host: str, port: int, bucket: str | None = None) -> Any:
    """A started in-memory emulator on host:port (``bucket`` created up front); ``.stop()`` ends it."""
    from gcp_storage_emulator.server import create_server

    patch()
    server = create_server(host, port, in_memory=True, default_bucket=bucket)
    server.start()
    return server


def main() -> None:
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        raise SystemExit("usage: python gcs.py HOST PORT")
    from gcp_storage_emulator.server import create_server

    patch()
    create_server(sys.argv[1], int(sys.argv[2]), in_memory=True).run()


if __name__ == "__main__":
    main()
