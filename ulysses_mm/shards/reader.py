"""Reading shards back: the samples of one tar, each member checked, ``.npy`` decoded with
``allow_pickle=False``; ``where`` names the shard in every error."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from typing import IO

import numpy as np

from ulysses_mm.core.format import (
    NUM_COLUMNS,
    SEGMENTS_KEY,
    TOKENS_KEY,
    PackedSample,
    ShardFormatError,
    load_npy,
)


def iter_samples(fileobj: IO[bytes], where: str = "shard") -> Iterator[PackedSample]:
    """Samples of one shard, in order, from a readable binary file object.

    Checks each sample's members and array types; ``where`` names the shard in errors."""
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r|")  # noqa: SIM115 (a stream over fileobj)
    except tarfile.TarError as e:
        raise ShardFormatError(f"{where}: not a tar file: {e}") from e
    pending: dict[str, bytes] = {}
    key: str | None = None
    try:
        for member in tar:
            if not member.isfile():
                continue
            k, _, ext = member.name.partition(".")
            if key is not None and k != key:
                yield _decode(key, pending, where)
                pending = {}
            key = k
            f = tar.extractfile(member)
            assert f is not None
            pending[ext] = f.read()
    except tarfile.TarError as e:
        raise ShardFormatError(f"{where}: truncated or corrupt tar: {e}") from e
    if key is not None:
        yield _decode(key, pending, where)


def _decode(key: str, members: dict[str, bytes], where: str) -> PackedSample:
    missing = {TOKENS_KEY, SEGMENTS_KEY} - set(members)
    if missing:
        raise ShardFormatError(f"{where}: sample {key} lacks {sorted(missing)}")
    if not key.isdigit():
        raise ShardFormatError(f"{where}: sample key {key!r} is not a sample index")
    tokens = load_npy(members[TOKENS_KEY], f"{where}: {key}.{TOKENS_KEY}")
    segments = load_npy(members[SEGMENTS_KEY], f"{where}: {key}.{SEGMENTS_KEY}")
    if tokens.ndim != 1 or tokens.dtype.kind != "u":
        raise ShardFormatError(
            f"{where}: {key}.{TOKENS_KEY} is {tokens.dtype} {tokens.shape}, expected unsigned [N]"
        )
    if segments.dtype != np.int64 or segments.ndim != 2 or segments.shape[1] != NUM_COLUMNS:
        raise ShardFormatError(
            f"{where}: {key}.{SEGMENTS_KEY} is {segments.dtype} {segments.shape}, "
            f"expected int64 [rows, {NUM_COLUMNS}]"
        )
    return PackedSample(int(key), tokens, segments)


def read_samples(data: bytes, where: str = "shard") -> list[PackedSample]:
    """Every sample of a shard held in memory."""
    return list(iter_samples(io.BytesIO(data), where))
