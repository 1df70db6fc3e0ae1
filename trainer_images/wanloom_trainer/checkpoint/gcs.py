"""Plain gs:// object I/O for checkpoints and weights (framework-free: both backends use it).

Objects are copied whole through google-cloud-storage (which honours ``STORAGE_EMULATOR_HOST``); training data
streams through ``data.storage`` instead, with range reads and retries.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GcsLocation:
    """``gs://bucket/prefix`` split into its parts (prefix without trailing slash, possibly empty)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> GcsLocation:
        bucket, _, prefix = uri.removeprefix("gs://").partition("/")
        if not bucket:
            raise ValueError(f"{uri!r} has no bucket; expected gs://bucket/prefix")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)


def bucket_of(location: GcsLocation) -> Any:
    from google.cloud import storage  # lazy: only gs:// checkpoints need it

    return storage.Client().bucket(location.bucket)


def upload_retry(seconds: float) -> Any:
    """google-cloud-storage's own retry policy for an upload (transient errors, backoff), ended after ``seconds``."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(seconds)


def upload_dir(local: Path, location: GcsLocation, *parts: str, retry_s: float | None = None) -> None:
    """Upload every file under ``local`` to ``gs://bucket/prefix/<parts>/<relative path>``; each file's upload is
    retried for ``retry_s`` seconds (None: the client's default, 120 s)."""
    bucket = bucket_of(location)
    kwargs = {} if retry_s is None else {"retry": upload_retry(retry_s)}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        bucket.blob(location.key(*parts, path.relative_to(local).as_posix())).upload_from_filename(str(path), **kwargs)


def download_prefix(location: GcsLocation, local: Path, *parts: str) -> int:
    """Download every object under ``gs://bucket/prefix/<parts>/`` into ``local``; returns the object count."""
    bucket, root = bucket_of(location), location.key(*parts) + "/"
    count = 0
    for blob in bucket.client.list_blobs(location.bucket, prefix=root):
        target = local / blob.name[len(root) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target))
        count += 1
    return count


def stage_weights(uri: str, local_root: Path, subfolders: Sequence[str]) -> Path:
    """Copy the expert folders of a ``gs://`` diffusers pipeline root to local disk, once.

    The copy lands in ``local_root/<hash of uri>/<subfolder>``; each subfolder is renamed into place only when
    complete, so an interrupted download is retried rather than loaded half-written.

    Raises:
        FileNotFoundError: naming ``spec.model.weights`` when a subfolder holds no object.
    """
    local = local_root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    location = GcsLocation.parse(uri)
    for folder in subfolders:
        if (local / folder).is_dir():
            continue
        partial = local / f".{folder}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        if download_prefix(location, partial, folder) == 0:
            raise FileNotFoundError(f"spec.model.weights: nothing under {uri}/{folder}/")
        partial.rename(local / folder)
    return local
