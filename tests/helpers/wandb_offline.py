"""Read an offline wandb run file (``run-<id>.wandb``) without network or the wandb service.

The file is wandb's LevelDB-style log: a 7-byte header (``:W&B`` magic, version, ...), then
32 KiB blocks of records, each ``crc32 (4) | length (2, little endian) | type (1) | payload``,
where type 1 = whole record, 2/3/4 = first/middle/last fragment. Each reassembled payload is a
``wandb_internal_pb2.Record`` protobuf. Test helper only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: str | Path):
    """Yield every ``wandb_internal_pb2.Record`` in ``path`` in file order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file (magic {data[:4]!r})")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        parts.append(payload)
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec


def history(path: str | Path) -> tuple[str, list[tuple[int, dict]]]:
    """``(run id, [(step, {metric: value}), ...])`` of one offline run file."""
    run_id, rows = None, []
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            items = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                items[key] = json.loads(item.value_json)
            rows.append((rec.history.step.num, items))
    return run_id, rows


def run_files(output_dir: str | Path) -> list[Path]:
    """Every offline run file under ``<output_dir>/wandb``, oldest first."""
    return sorted(Path(output_dir).glob("wandb/offline-run-*/run-*.wandb"))


def config(path: str | Path) -> dict:
    """The run's config as its offline file records it (``{key: value}``, wandb's own
    ``_wandb`` entry included: e.g. ``_wandb["branch_point"]`` of a fork)."""
    out = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            for item in rec.run.config.update:
                out[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                key = item.key or "/".join(item.nested_key)
                out[key] = json.loads(item.value_json)
    return out
