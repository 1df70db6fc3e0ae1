"""The inputs of a prepare, in a fixed order: a manifest, or a folder / gs:// prefix of media with sidecar captions.

A **manifest** (``.jsonl``, ``.csv`` or ``.parquet``; a path or a gs:// URI) has one row per sample:

- ``path``: the media file, a gs:// URI or a path relative to the manifest's folder (or absolute);
- ``caption``, or ``caption_path`` (a text file, resolved like ``path``);
- ``start`` / ``end`` (optional, seconds): a clip cut from a longer video;
- ``id`` (optional, unique): how the dataset names the sample (default: ``path``, with the bounds).

A **folder or gs:// prefix** holds images (png/jpg/webp/bmp) and videos (mp4/mov/webm/mkv/avi/m4v), each with a
caption in a sidecar text file of the same stem (``clip.mp4`` + ``clip.txt``), listed in sorted order.

Row order (or the sorted listing) fixes each sample's ordinal, and so its key and its shard. Media are read where
they are: gs:// objects through ranged reads (``open_media``), never copied whole first. A bad row (not JSON, no
path, no caption, bad bounds, a repeated id) or a medium without its caption keeps its ordinal and carries the
problem (``SourceItem.problem``, "<kind>: <where and what>"): the pipeline lists it as skipped, it never stops the
corpus. A manifest that cannot be read at all (missing, no rows, a CSV without a path column) is an error.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from wanloom_trainer.data.prepare.media import IMAGE_EXTS, VIDEO_EXTS, media_kind
from wanloom_trainer.data.storage import GCS_SCHEME, open_storage, split_uri

MANIFEST_SUFFIXES = (".jsonl", ".csv", ".parquet")
_FIELDS = {"path", "caption", "caption_path", "start", "end", "id"}


@dataclass(frozen=True)
class SourceItem:
    """One input sample.

    Attributes:
        ordinal: position in the ordered inputs: the sample key and its shard derive from it.
        uri: the media file, a local path or gs:// URI.
        source: the sample's name in the dataset (index ``sources``, skip lists).
        caption: its text.
        start, end: seconds of a longer video this sample is cut from (None: the whole file).
        problem: why this input cannot be used ("<kind>: <detail>", kinds in ``SKIP_KINDS``), or None.
    """

    ordinal: int
    uri: str
    source: str
    caption: str
    start: float | None = None
    end: float | None = None
    problem: str | None = None


# What a skipped input's reason starts with: the status and metrics count skips by these.
SKIP_KINDS = ("bad-row", "duplicate-id", "no-caption", "missing", "undecodable", "no-bucket")


def skip_kind(reason: str) -> str:
    """The kind a skip reason names (its text before the first colon, when that is a known kind)."""
    kind = reason.split(":", 1)[0].strip()
    return kind if kind in SKIP_KINDS else "other"


class _BadRow(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")


def read_sources(spec: str | Path) -> list[SourceItem]:
    """The ordered inputs ``spec`` names: a manifest file (by its suffix), else a folder or gs:// prefix."""
    text = str(spec)
    if text.lower().endswith(MANIFEST_SUFFIXES):
        return read_manifest(text)
    if text.lower().endswith(".json"):
        raise ValueError(f"{text}: a manifest is JSON Lines (.jsonl), CSV (.csv) or Parquet (.parquet)")
    return scan_media(text)


def scan_media(root: str) -> list[SourceItem]:
    """Media under a folder or gs:// prefix, sorted, with their sidecar captions; missing captions are an error."""
    if not root.startswith(GCS_SCHEME) and not Path(root).is_dir():
        raise FileNotFoundError(f"input folder {root} does not exist")
    storage = open_storage(root)
    names = storage.list()
    present = set(names)
    media = [n for n in names if media_kind(n) is not None]
    if not media:
        raise ValueError(
            f"{root} holds no images or videos ({', '.join(sorted(IMAGE_EXTS | VIDEO_EXTS))}), and is not a manifest "
            f"({', '.join(MANIFEST_SUFFIXES)})"
        )
    items = []
    for i, name in enumerate(media):
        sidecar = str(Path(name).with_suffix(".txt"))
        caption = _caption(storage.read(sidecar)) if sidecar in present else ""
        problem = None if caption else f"no-caption: {storage.join(sidecar)} is missing, empty or not UTF-8 text"
        items.append(SourceItem(i, storage.join(name), name, caption, problem=problem))
    return items


def _caption(data: bytes) -> str:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return ""


def read_manifest(uri: str) -> list[SourceItem]:
    """The rows of a JSONL, CSV or Parquet manifest as ordered inputs (module docstring)."""
    folder, name = split_uri(uri)
    storage = open_storage(folder)
    try:
        data = storage.read(name)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"manifest {uri} does not exist") from exc
    rows = _parse(uri, data)
    if not rows:
        raise ValueError(f"manifest {uri} has no rows")
    items, ids = [], {}
    for n, row in enumerate(rows):
        try:
            if isinstance(row, _BadRow):
                raise row
            item = _item(uri, folder, storage, n, row)
            if item.source in ids:
                raise _BadRow(
                    "duplicate-id",
                    f"manifest {uri} row {n + 1}: id {item.source!r} repeats row {ids[item.source] + 1}",
                )
        except _BadRow as exc:
            given = row.get("id") if isinstance(row, dict) else None
            source = str(given) if isinstance(given, str | int) else f"{uri}#row{n + 1}"
            items.append(SourceItem(n, "", source, "", problem=str(exc)))
            continue
        ids[item.source] = n
        items.append(item)
    return items


def _parse(uri: str, data: bytes) -> list[dict[str, Any] | _BadRow]:
    """The manifest's rows; a JSONL line that is no JSON object stays in place as a ``_BadRow``."""
    suffix = uri.lower().rsplit(".", 1)[-1]
    if suffix == "jsonl":
        rows: list[dict[str, Any] | _BadRow] = []
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                rows.append(_BadRow("bad-row", f"manifest {uri} line {n + 1}: not JSON ({exc.msg})"))
                continue
            if not isinstance(row, dict):
                row = _BadRow("bad-row", f"manifest {uri} line {n + 1}: a row must be a JSON object with a 'path'")
            rows.append(row)
        return rows
    if suffix == "csv":
        reader = csv.DictReader(io.StringIO(data.decode("utf-8")))
        if reader.fieldnames is None or "path" not in reader.fieldnames:
            raise ValueError(f"manifest {uri}: the CSV header must name a 'path' column (and caption or caption_path)")
        return [{k: v for k, v in row.items() if v not in (None, "")} for row in reader]
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(
            f"manifest {uri}: reading Parquet needs pyarrow (pip install 'wanloom[parquet]'), or write the manifest as "
            "JSON Lines or CSV"
        ) from exc
    return [{k: v for k, v in row.items() if v is not None} for row in pq.read_table(io.BytesIO(data)).to_pylist()]


def _item(uri: str, folder: str, storage: Any, n: int, row: dict[str, Any]) -> SourceItem:
    where = f"manifest {uri} row {n + 1}"
    unknown = sorted(set(row) - _FIELDS)
    if unknown:
        raise _BadRow("bad-row", f"{where}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(_FIELDS))}")
    path = row.get("path")
    if not isinstance(path, str) or not path.strip():
        raise _BadRow("bad-row", f"{where}: 'path' must name the media file (a gs:// URI or a path relative to it)")
    if media_kind(path) is None:
        kinds = ", ".join(sorted(IMAGE_EXTS | VIDEO_EXTS))
        raise _BadRow("bad-row", f"{where}: path {path!r} is neither an image nor a video ({kinds})")
    start, end = _seconds(where, row, "start"), _seconds(where, row, "end")
    if start is not None and end is not None and end <= start:
        raise _BadRow("bad-row", f"{where}: end {end:g} s must be after start {start:g} s")
    if (start is not None or end is not None) and media_kind(path) != "video":
        raise _BadRow("bad-row", f"{where}: start/end cut clips from videos; {path!r} is an image")
    caption = row.get("caption")
    if caption is None and "caption_path" in row:
        caption = _read_text(_resolve(folder, str(row["caption_path"])), where)
    if not isinstance(caption, str) or not caption.strip():
        raise _BadRow(
            "no-caption", f"{where}: needs a non-empty 'caption' or a 'caption_path' to a non-empty text file"
        )
    source = row.get("id")
    if source is None:
        bounds = "" if start is None and end is None else f"#{start or 0:g}-{'' if end is None else f'{end:g}'}"
        source = f"{path}{bounds}"
    return SourceItem(n, _resolve(folder, path), str(source), caption.strip(), start, end)


def _seconds(where: str, row: dict[str, Any], field: str) -> float | None:
    value = row.get(field)
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise _BadRow("bad-row", f"{where}: '{field}' must be seconds >= 0, got {value!r}")
    return seconds


def _resolve(folder: str, path: str) -> str:
    if path.startswith(GCS_SCHEME) or path.startswith("/"):
        return path
    return f"{folder.rstrip('/')}/{path}"


def _read_text(uri: str, where: str) -> str:
    folder, name = split_uri(uri)
    try:
        return _caption(open_storage(folder).read(name))
    except FileNotFoundError as exc:
        raise _BadRow("no-caption", f"{where}: caption_path {uri} does not exist") from exc


@contextlib.contextmanager
def open_media(uri: str) -> Iterator[Path | BinaryIO]:
    """A local path as it is, or a gs:// object as a seekable reader fetching byte ranges on demand."""
    if not uri.startswith(GCS_SCHEME):
        if not Path(uri).is_file():
            raise FileNotFoundError(f"{uri}: not found")  # listed as missing, like an absent gs:// object
        yield Path(uri)
        return
    bucket, _, name = uri[len(GCS_SCHEME) :].partition("/")
    with open_storage(f"{GCS_SCHEME}{bucket}").open_stream(name) as stream:
        yield stream
