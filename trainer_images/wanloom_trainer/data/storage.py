"""Dataset storage: a local directory or a ``gs://bucket/prefix``, behind one small interface.

Reads are byte ranges (one request per sample, see index.py) or front-to-back streams. GCS requests retry
transient failures (429, 5xx, dropped connections, timeouts) with capped exponential backoff and full jitter
(``RetryPolicy``); the google client's own retry is switched off so that attempts are bounded, counted in
``stats`` and visible in tests. ``STORAGE_EMULATOR_HOST`` (e.g. gcp-storage-emulator) switches the client to
anonymous credentials, which is how the tests and the benchmark run offline.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import random
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

T = TypeVar("T")
GCS_SCHEME = "gs://"
TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}  # statuses worth retrying (checkpoint saves use it too)


class MissingObject(FileNotFoundError):
    """The shard or index object does not exist (not retried)."""


STREAM_RETRY_S = 10.0  # how long one chunk of a streamed read is retried


class TransientStorageError(OSError):
    """A transient error persisted through every retry."""


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: attempt k waits U(0, min(max_delay, initial·multiplier^k))."""

    attempts: int = 6
    initial_delay: float = 0.1
    multiplier: float = 2.0
    max_delay: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be >= 1, got {self.attempts}")

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_delay, self.initial_delay * self.multiplier**attempt))


class StorageStats:
    """Thread-safe request counters (requests, retries, bytes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.retries = self.bytes_read = 0

    def add(self, requests: int = 0, retries: int = 0, bytes_read: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.retries += retries
            self.bytes_read += bytes_read


class Storage(ABC):
    """Objects addressed by names relative to the root ``uri`` ('shards/shard-000000.tar')."""

    # Whether reads wait on a network round trip: then a load overlaps its samples' reads in threads; a local read
    # is CPU work that a thread hand-off only slows down.
    remote: bool = True

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.stats = StorageStats()

    @abstractmethod
    def read(self, name: str) -> bytes: ...

    @abstractmethod
    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``; a short object raises EOFError."""

    @abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` atomically (readers see the old or the new object, never a part)."""

    @abstractmethod
    def upload(self, name: str, path: Path) -> None:
        """Copy the local file ``path`` to ``name``, atomically."""

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def open_stream(self, name: str) -> BinaryIO: ...

    @abstractmethod
    def upload_if_absent(self, name: str, path: Path) -> bool:
        """``upload`` unless ``name`` exists; False when it did (its object stands)."""

    @abstractmethod
    def md5(self, name: str) -> str:
        """The object's MD5, hex (GCS keeps it with every object: nothing is downloaded)."""

    @abstractmethod
    def write_if_absent(self, name: str, data: bytes) -> bool:
        """Create ``name`` atomically unless it exists (GCS: ``ifGenerationMatch=0``); False when it did: another
        writer won, and its object stands."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names under ``prefix`` (relative to the root, sorted), recursively."""

    def join(self, name: str) -> str:
        return f"{self.uri.rstrip('/')}/{name}"


class LocalStorage(Storage):
    remote = False

    def __init__(self, root: str | Path) -> None:
        super().__init__(str(root))
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        return self.root / name

    def read(self, name: str) -> bytes:
        try:
            data = self._path(name).read_bytes()
        except FileNotFoundError as exc:
            raise MissingObject(f"{self.join(name)} does not exist") from exc
        self.stats.add(requests=1, bytes_read=len(data))
        return data

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        try:
            with self._path(name).open("rb") as f:
                f.seek(offset)
                data = f.read(length)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError as exc:
            raise MissingObject(f"{self.join(name)} does not exist") from exc
        self.stats.add(requests=1, bytes_read=len(data))
        if len(data) != length:
            raise EOFError(
                f"{self.join(name)}: wanted bytes {offset:,}..{offset + length - 1:,}, but the file is {size:,} bytes "
                "long (truncated?)"
            )
        return data

    def write(self, name: str, data: bytes) -> None:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def upload(self, name: str, path: Path) -> None:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)

    def exists(self, name: str) -> bool:
        return self._path(name).exists()

    def open_stream(self, name: str) -> BinaryIO:
        try:
            return self._path(name).open("rb")
        except FileNotFoundError as exc:
            raise MissingObject(f"{self.join(name)} does not exist") from exc

    def upload_if_absent(self, name: str, path: Path) -> bool:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        shutil.copyfile(path, tmp)
        return self._link(tmp, target)

    def md5(self, name: str) -> str:
        digest = hashlib.md5(usedforsecurity=False)
        with self.open_stream(name) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def write_if_absent(self, name: str, data: bytes) -> bool:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        return self._link(tmp, target)

    @staticmethod
    def _link(tmp: Path, target: Path) -> bool:
        try:
            os.link(tmp, target)  # atomic, and fails where the name exists
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return []
        found = base.rglob("*") if base.is_dir() else [base]
        return sorted(p.relative_to(self.root).as_posix() for p in found if p.is_file() and not p.name.startswith("."))


def is_transient(exc: BaseException) -> bool:
    """Whether a GCS call failure is worth retrying: throttling, server errors, dropped connections, timeouts."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.GoogleAPICallError):
        return getattr(exc, "code", None) in TRANSIENT_HTTP
    if isinstance(exc, gexc.RetryError):  # the client's own retry ran out on a transient error
        return exc.cause is None or is_transient(exc.cause)
    import requests
    from google.auth import exceptions as auth_exc

    transient = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)
    if isinstance(exc, (*transient, auth_exc.TransportError, ConnectionError, TimeoutError)):
        return True
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status in TRANSIENT_HTTP


def _gcs_client() -> Any:
    from google.cloud import storage as gcs

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "wanloom")
        return gcs.Client(project=project, credentials=AnonymousCredentials())
    return gcs.Client()


class GCSStorage(Storage):
    """``gs://bucket/prefix``. One client per thread: the google client does not promise thread safety."""

    def __init__(self, uri: str, retry: RetryPolicy | None = None) -> None:
        super().__init__(uri.rstrip("/"))
        bucket, _, prefix = uri[len(GCS_SCHEME) :].partition("/")
        if not bucket:
            raise ValueError(f"{uri!r} names no bucket; expected gs://bucket/prefix")
        self.bucket_name, self.prefix = bucket, prefix.strip("/")
        self.retry = retry or RetryPolicy()
        self._local = threading.local()

    def _blob(self, name: str) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = _gcs_client()
        return client.bucket(self.bucket_name).blob(f"{self.prefix}/{name}" if self.prefix else name)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from google.api_core import exceptions as gexc

        for attempt in range(self.retry.attempts):
            self.stats.add(requests=1, retries=int(attempt > 0))
            try:
                return fn()
            except gexc.NotFound as exc:
                raise MissingObject(f"{what}: not found") from exc
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if attempt + 1 == self.retry.attempts:
                    raise TransientStorageError(f"{what}: gave up after {self.retry.attempts} attempts: {exc}") from exc
                self.retry.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")

    def read(self, name: str) -> bytes:
        data = self._call(self.join(name), lambda: self._blob(name).download_as_bytes(retry=None))
        self.stats.add(bytes_read=len(data))
        return data

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        end = offset + length - 1  # GCS ranges are inclusive

        def fetch() -> bytes:
            from google.api_core import exceptions as gexc

            try:
                return self._blob(name).download_as_bytes(start=offset, end=end, checksum=None, retry=None)
            except gexc.RequestRangeNotSatisfiable:
                return b""  # the object is shorter than the index says: reported as truncated below

        data = self._call(f"{self.join(name)} bytes {offset}-{end}", fetch)
        self.stats.add(bytes_read=len(data))
        if len(data) != length:
            raise EOFError(
                f"{self.join(name)}: wanted bytes {offset:,}..{end:,}, got {len(data):,} (the object is shorter than "
                "the index says: truncated?)"
            )
        return data

    def write(self, name: str, data: bytes) -> None:
        self._call(self.join(name), lambda: self._blob(name).upload_from_string(data, retry=None))

    def upload(self, name: str, path: Path) -> None:
        self._call(self.join(name), lambda: self._blob(name).upload_from_filename(str(path), retry=None))

    def exists(self, name: str) -> bool:
        return bool(self._call(self.join(name), lambda: self._blob(name).exists(retry=None)))

    def open_stream(self, name: str) -> BinaryIO:
        if not self.exists(name):
            raise MissingObject(f"{self.join(name)}: not found")
        from google.cloud.storage.retry import DEFAULT_RETRY

        # A short retry of the chunk requests (the client's default waits up to 120 s): blips are absorbed, an
        # outage reaches the caller soon as a transient error, to be waited out where the whole read can be redone.
        return self._blob(name).open("rb", chunk_size=8 << 20, retry=DEFAULT_RETRY.with_timeout(STREAM_RETRY_S))

    def write_if_absent(self, name: str, data: bytes) -> bool:
        return self._create(name, lambda blob: blob.upload_from_string(data, if_generation_match=0, retry=None))

    def upload_if_absent(self, name: str, path: Path) -> bool:
        return self._create(name, lambda blob: blob.upload_from_filename(str(path), if_generation_match=0, retry=None))

    def _create(self, name: str, upload: Callable[[Any], None]) -> bool:
        from google.api_core import exceptions as gexc

        def create() -> bool:
            try:
                upload(self._blob(name))
            except gexc.PreconditionFailed:
                return False
            return True

        return self._call(self.join(name), create)

    def md5(self, name: str) -> str:
        def fetch() -> str:
            blob = self._blob(name)
            blob.reload(retry=None)
            return base64.b64decode(blob.md5_hash).hex()

        return self._call(self.join(name), fetch)

    def delete(self, name: str) -> None:
        with contextlib.suppress(MissingObject):
            self._call(self.join(name), lambda: self._blob(name).delete(retry=None))

    def list(self, prefix: str = "") -> list[str]:
        full = "/".join(p.strip("/") for p in (self.prefix, prefix) if p)
        full = f"{full}/" if full else ""  # a folder: not its siblings that share the name's start
        client = getattr(self._local, "client", None) or _gcs_client()
        self._local.client = client
        blobs = self._call(
            f"{self.join(prefix)} (list)", lambda: list(client.list_blobs(self.bucket_name, prefix=full, retry=None))
        )
        strip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(b.name[strip:] for b in blobs if not b.name.endswith("/"))


def open_storage(uri: str | Path, retry: RetryPolicy | None = None) -> Storage:
    """Storage rooted at ``uri``: ``gs://bucket/prefix``, ``file:///path`` or a plain path."""
    text = str(uri)
    if text.startswith(GCS_SCHEME):
        return GCSStorage(text, retry)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"unsupported dataset URI {text!r}; use gs://bucket/prefix or a local path")
    return LocalStorage(Path(text.removeprefix("file://")))


def split_uri(uri: str) -> tuple[str, str]:
    """'gs://b/p/index.json' → ('gs://b/p', 'index.json'); the same for paths."""
    text = str(uri).rstrip("/")
    if "/" not in text:
        return ".", text
    head, _, tail = text.rpartition("/")
    if not tail or head.endswith(":/") or (text.startswith(GCS_SCHEME) and "/" not in text[len(GCS_SCHEME) :]):
        raise ValueError(f"{uri!r} does not name an object inside a directory or bucket")
    return head or "/", tail
