"""The load hook: convert a stock checkpoint once into a cache folder and load that
(:func:`prepare_load`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional

from ckpt.format.records import saved_layout
from ckpt.stock.analysis import analyze
from ckpt.stock.conversion import CONVERTED_BY, CONVERTED_KEY, broadcast_object, convert, fingerprint
from ckpt.stock.format import SHARDING_RECORD_KEY, TRACKER, StockCheckpointError, checkpoint_format
from ckpt.stock.specs import get_path

# Cache folder (under the checkpoint root) that prepare_load converts stock checkpoints into.
CONVERTED_DIR = "gtp_converted"


def _cached(cache_iter: Path, src_iter: Path) -> bool:
    from megatron.core import dist_checkpointing

    if not (cache_iter / "metadata.json").is_file() or not (cache_iter / ".metadata").is_file():
        return False
    try:
        rec = dist_checkpointing.load_common_state_dict(str(cache_iter)).get(CONVERTED_KEY) or {}
    except Exception:  # noqa: BLE001 - a torn cache entry is rebuilt
        return False
    fp = fingerprint(src_iter)
    return all(rec.get(k) == v for k, v in fp.items()) and \
        rec.get("converted_by") == CONVERTED_BY


def prepare_load(path, common: Mapping, layout_record: Optional[Mapping] = None,
                 stock_writer: bool = False, cache_root=None) -> tuple[Path, bool]:
    """Where to load ``path`` from: itself, or its logical conversion (collective).

    Every rank of the default group calls this with the same arguments. For a checkpoint that
    is not stock it returns ``(path, False)`` without reading anything beyond metadata. For a
    stock one (stock 0.19.2 GTP format with padded or gated GTP weights) it returns
    ``(converted_iter_dir, True)``: rank 0 converts it once (:func:`convert`) into
    ``<cache_root or path.parent/gtp_converted>/iter_XXXXXXX`` and later loads reuse it while the
    source is unchanged. Exception: when the loader itself writes the stock format
    (``stock_writer``) and its layout record equals the checkpoint's, the stock file is loaded
    as is (megatron's same-layout resume is self-consistent).

    Raises:
        StockCheckpointError: the stock checkpoint cannot be read exactly (on every rank), or
            the cache folder cannot be written (the message says how to convert elsewhere).
    """
    import torch

    path = Path(path)
    if checkpoint_format(common) == "logical":
        return path, False
    degrees = [get_path(common, rec, key) for rec in ("layout", SHARDING_RECORD_KEY)
               for key in ("gtp_remat_size", "expert_gtp_remat_size")]
    if max(int(d or 0) for d in degrees) <= 1:
        return path, False
    if stock_writer and layout_record is not None and saved_layout(common) == dict(layout_record):
        return path, False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cache_root = Path(cache_root) if cache_root else path.parent / CONVERTED_DIR
    cache_iter = cache_root / path.name
    decision = None
    if rank == 0:
        try:
            analysis = analyze(path, common=common)
            if not analysis.stock:
                decision = ("as_is", str(path))
            elif _cached(cache_iter, path):
                decision = ("cached", str(cache_iter))
            else:
                try:
                    cache_root.mkdir(parents=True, exist_ok=True)
                    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=cache_root))
                    decision = ("convert", str(staging))
                except OSError as exc:
                    decision = ("error", (
                        f"{path} is a stock GTP checkpoint (megatron-core 0.19.2 padded format) "
                        f"and its converted copy cannot be written to {cache_root}: {exc}. "
                        f"Convert it elsewhere: `python -m gtp convert {path} DST` and load DST"))
        except StockCheckpointError as exc:
            decision = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
            decision = ("error", f"cannot read {path}: {type(exc).__name__}: {exc}")
    kind, where = broadcast_object(decision)
    if kind == "error":
        raise StockCheckpointError(where)
    if kind == "as_is":
        return path, False
    if kind == "convert":
        # Written into a private staging root, then moved into place by rank 0, so a
        # concurrent job loading the same checkpoint never reads a half-written copy.
        staging = Path(where)
        # convert names its iter dir from the recorded iteration, which may differ from
        # (or be missing beside) the source folder's name.
        written = convert(path, staging)
        if rank == 0:
            try:
                if not _cached(cache_iter, path):
                    if cache_iter.exists():
                        shutil.rmtree(cache_iter)
                    os.replace(written, cache_iter)
                    tmp = cache_root / f"{TRACKER}.{staging.name}"
                    tmp.write_text(f"{int(path.name[5:]) if path.name[5:].isdigit() else 0}\n")
                    os.replace(tmp, cache_root / TRACKER)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        where = str(cache_iter)
    return Path(where), True
