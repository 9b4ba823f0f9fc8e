"""Reads a W&B offline run's transaction log (``run-{id}.wandb``): wandb 0.31 keeps no Python reader of its
own (the Go service reads it), so the log's framing (LevelDB's: 32 KiB blocks of records, each with a 7-byte
header of checksum, length and type, after a 7-byte ``:W&B`` file header) is undone here and each record is
parsed by wandb's own protobuf message, ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is no W&B transaction log"
    out, parts, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def history(directory: Path) -> list[dict[str, Any]]:
    """Every history row of every offline run under ``directory`` (a resumed run starts a new one)."""
    rows = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows
