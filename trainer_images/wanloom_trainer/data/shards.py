"""Tar shards: writing them with every member's byte range recorded, and streaming them back.

The writer produces plain POSIX tar files that ``webdataset.WebDataset`` reads unchanged. It also returns, per
sample, where each member's payload starts and how long it is, so the index can send one byte-range request per
sample instead of reading whole shards. Headers carry fixed mtime/owner fields so the same samples always produce
the same bytes, which is what makes an interrupted ``prepare`` resumable shard by shard.
"""

from __future__ import annotations

import io
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from wanloom_trainer.data.format import MEMBERS

_BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class SampleLocation:
    """Where one sample's members lie inside its shard.

    Attributes:
        span: (offset, length) of the byte range from the first member's payload to the end of the last one.
        members: per name in ``MEMBERS``, (offset relative to span start, size); (-1, 0) for an absent member.
        crc32: CRC-32 of the member payloads concatenated in ``MEMBERS`` order.
    """

    span: tuple[int, int]
    members: tuple[tuple[int, int], ...]
    crc32: int


def payload_crc(payloads: list[bytes | memoryview]) -> int:
    crc = 0
    for data in payloads:
        crc = zlib.crc32(data, crc)
    return crc


class ShardWriter:
    """Appends samples to one tar file. Use as a context manager; ``add`` returns each sample's location."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tar = tarfile.open(self.path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 (closed by close())
        self.count = 0

    def add(self, key: str, members: dict[str, bytes]) -> SampleLocation:
        unknown = set(members) - set(MEMBERS)
        if unknown:
            raise ValueError(f"sample {key}: unknown members {sorted(unknown)}; valid: {', '.join(MEMBERS)}")
        absolute: dict[str, tuple[int, int]] = {}
        for name in MEMBERS:
            if name in members:
                absolute[name] = (self._add_member(f"{key}.{name}", members[name]), len(members[name]))
        start = min(off for off, _ in absolute.values())
        end = max(off + size for off, size in absolute.values())
        rel = tuple((absolute[n][0] - start, absolute[n][1]) if n in absolute else (-1, 0) for n in MEMBERS)
        self.count += 1
        return SampleLocation((start, end - start), rel, payload_crc([members[n] for n in MEMBERS if n in members]))

    def _add_member(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "", ""
        self._tar.addfile(info, io.BytesIO(data))
        # tarfile pads the payload to whole blocks; the payload therefore starts that far before the new offset.
        return self._tar.offset - _padded(len(data))

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def stream_shard(stream: BinaryIO) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Read a shard front to back (no seeking), yielding (key, {member: bytes}) per sample in file order."""
    key: str | None = None
    group: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            if not info.isfile():
                continue
            base = info.name.rsplit("/", 1)[-1]
            k, _, ext = base.partition(".")
            if key is not None and k != key:
                yield key, group
                group = {}
            key = k
            fileobj = tar.extractfile(info)
            group[ext] = fileobj.read() if fileobj is not None else b""
    if key is not None:
        yield key, group
