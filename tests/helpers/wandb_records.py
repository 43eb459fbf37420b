"""Read the history a W&B offline run logged, from its ``run-*.wandb`` file.

The file is W&B's record log: a 7-byte header, then 32 KiB blocks of records framed as in
LevelDB's log format (crc32, length, type FULL/FIRST/MIDDLE/LAST), each record a
``wandb_internal_pb2.Record`` protobuf. W&B 0.2x+ keeps its reader in Go, so the tests
read the frames themselves and let W&B's own protobuf classes parse the records.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log"
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:  # zero fill to the end of the block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return out


def history(run_dir: Path) -> list[dict[str, object]]:
    """Every ``run.log`` row of an offline run directory, values JSON-decoded."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows
