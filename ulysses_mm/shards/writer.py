"""The shard format: WebDataset tar files of packed samples, byte-for-byte reproducible.

One sample is two tar members under ``__key__ = f"{global_sample_index:09d}"``::

    000000042.segments.npy   int64 [rows, 5]   segment table (see ulysses_mm.core.format)
    000000042.tokens.npy     uint8|16|32 [N]   TokenSpace.dtype(), the smallest that holds it

written in the tar layout of webdataset's ``TarWriter`` (so ``tar -tf`` and
``webdataset.WebDataset`` read it; :mod:`.reader` reads it back), byte for byte, by the standard library's ``tarfile``
(webdataset itself imports torch) with every header field fixed (mtime 0, uid/gid 0,
fixed user names) and the
arrays serialised by ``numpy.lib.format`` without pickle, so the same samples always give
the same bytes and the same sha256. Shards are named ``shard-000000.tar`` … and roll over
before the next sample would take one past ``max_bytes`` (or ``max_samples``).

A shard is written to a temporary name and handed to a ``publish`` callback only when
complete (the pipeline renames it into place or uploads it), with its size and sha256
computed while writing.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ulysses_mm.core.format import (
    SEGMENTS_KEY,
    TOKENS_KEY,
    PackedSample,
)
from ulysses_mm.core.storage import temp_name

_BLOCK = tarfile.BLOCKSIZE  # 512: header and data padding unit
_RECORD = tarfile.RECORDSIZE  # 10240: a streamed tar is padded to a multiple of this


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def sample_key(index: int) -> str:
    return f"{index:09d}"


def npy_bytes(array: np.ndarray) -> bytes:
    """``.npy`` bytes of ``array`` (format 1.0 header; no pickle; deterministic)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def encode_sample(sample: PackedSample) -> dict[str, Any]:
    """The webdataset dict of a sample (bytes values)."""
    return {
        "__key__": sample_key(sample.index),
        TOKENS_KEY: npy_bytes(sample.tokens),
        SEGMENTS_KEY: npy_bytes(np.asarray(sample.segments, dtype=np.int64)),
    }


def _member_bytes(size: int) -> int:
    return _BLOCK + -(-size // _BLOCK) * _BLOCK


def _tar_size(member_bytes: int) -> int:
    """Size of a streamed tar holding ``member_bytes`` of headers+data (two zero blocks at
    the end, then padding to a whole record)."""
    return -(-(member_bytes + 2 * _BLOCK) // _RECORD) * _RECORD


@dataclass
class ShardRecord:
    """A finished shard, as recorded in the manifest."""

    name: str
    samples: int
    first_sample: int
    bytes: int
    sha256: str


class _TarStream:
    """What webdataset's ``TarWriter(f, encoder=False, mtime=0, user=…, group=…, mode=0o444)``
    writes, byte for byte: members ``KEY.EXT`` in sorted order, every header field fixed,
    so identical samples give identical bytes."""

    def __init__(self, f: _HashingWriter) -> None:
        # a stream ("w|") only writes; typeshed asks every mode's file methods of fileobj
        self._tar = tarfile.open(fileobj=f, mode="w|")  # type: ignore[call-overload]  # noqa: SIM115

    def write(self, obj: dict[str, Any]) -> None:
        key = obj["__key__"]
        for name in sorted(obj):
            if name.startswith("_"):
                continue
            data = obj[name]
            info = tarfile.TarInfo(f"{key}.{name}")
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o444
            info.uname = info.gname = "ulysses"
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()


class _HashingWriter:
    """File wrapper that hashes and counts what the tar stream writes."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


class ShardWriter:
    """Writes samples into size-limited shards in a local ``directory``.

    Each shard is written under a temporary name in ``directory``; once closed,
    ``publish(temp_path, record)`` must move it to its final place (``record.name``, which
    starts with ``prefix``). ``close`` finishes the last shard and returns every record."""

    def __init__(
        self,
        directory: Path,
        publish: Callable[[Path, ShardRecord], None],
        max_bytes: int = 256 << 20,
        max_samples: int = 0,
        prefix: str = "",
    ) -> None:
        self.directory = Path(directory)
        self.prefix = prefix  # of the records' names (a partition's folder, "part-00007/")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.publish = publish
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self.records: list[ShardRecord] = []
        self._file: IO[bytes] | None = None
        self._hw: _HashingWriter | None = None
        self._tar: _TarStream | None = None
        self._tmp: Path | None = None
        self._samples = 0
        self._first = 0
        self._members = 0

    def write(self, sample: PackedSample) -> None:
        obj = encode_sample(sample)
        size = sum(_member_bytes(len(v)) for k, v in obj.items() if k != "__key__")
        if self._tar is not None and (
            _tar_size(self._members + size) > self.max_bytes
            or (self.max_samples and self._samples >= self.max_samples)
        ):
            self._finish_shard()
        if self._tar is None:
            self._open(sample.index)
        assert self._tar is not None
        self._tar.write(obj)
        self._members += size
        self._samples += 1

    def _open(self, first_sample: int) -> None:
        name = shard_name(len(self.records))
        self._tmp = self.directory / temp_name(name)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in _finish_shard/abort)
        self._hw = _HashingWriter(self._file)
        self._tar = _TarStream(self._hw)
        self._first = first_sample
        self._samples = 0
        self._members = 0

    def _finish_shard(self) -> None:
        assert self._tar is not None and self._hw is not None and self._file is not None
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())  # durable before it is renamed into place
        self._file.close()
        expected = _tar_size(self._members)
        if self._hw.size != expected:  # the rollover arithmetic relies on this
            raise RuntimeError(f"shard size {self._hw.size} != predicted {expected}")
        record = ShardRecord(
            name=self.prefix + shard_name(len(self.records)),
            samples=self._samples,
            first_sample=self._first,
            bytes=self._hw.size,
            sha256=self._hw.sha.hexdigest(),
        )
        tmp = self._tmp
        assert tmp is not None
        self._tar = self._hw = self._file = self._tmp = None
        self.records.append(record)
        self.publish(tmp, record)

    def close(self) -> list[ShardRecord]:
        if self._tar is not None:
            self._finish_shard()
        return self.records

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file)."""
        if self._file is not None:
            self._file.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._tar = self._hw = self._file = self._tmp = None
