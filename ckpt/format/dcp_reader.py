"""Read only the bytes a load asks for from torch DCP's ``torch.save`` records.

torch DCP's ``FileSystemReader.read_data`` (torch 2.14) ``torch.load``s every stored chunk a
read request touches, whole, then narrows it to the request and copies it into the target. A
rank of a cross-layout load whose rows cover part of a stored chunk (tp2 x g2 saved, tp1 x g4
loaded: each rank's rows overlap two chunks of the source) reads all of both. :func:`install`
routes ``read_data`` through :func:`read_data`, which, for a request that is one contiguous run
of the stored tensor's elements (a block of rows, the whole tensor, part of one row), reads
exactly that run of bytes from the record's storage: straight into the target tensor when it is
contiguous, else into one reused scratch buffer and then into the target (a column slice of a
live tensor, where a TP split along dim 1 lands). Every other request (object items, transformed
streams, a record that is not one plain little-endian tensor, a strided slice of the stored
tensor such as one TP rank's columns of a tensor stored whole) goes to torch's own
``read_data``, unchanged.

Integrity: a read that covers a whole stored entry checks it against the CRC-32 the record's
zip directory holds (``torch.save`` writes one per entry): ``data.pkl`` and ``byteorder``
always, the storage when the request covers all of it, and every entry of a record handed to
torch's reader (which reads it whole and checks none; a record that is no zip archive, an
object stored raw, has none). A run that covers part of a storage cannot be checked:
:mod:`ckpt.verify` checks every byte of a checkpoint before a load (``docs/integrity.md``).

Each record is parsed by :mod:`ckpt.format.dcp_records` (a restricted unpickler; nothing in the file
runs code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from typing import Any, Optional

import torch

from ckpt.format.dcp_records import (  # noqa: F401 - DataFileError, read_record: part of this API
    DataFileError,
    TensorRecord,
    contiguous_run,
    read_record,
)
from ckpt.format.zip_records import (  # noqa: F401 - RecordDamaged, check_record: part of this API
    CHECK_BLOCK as _CHECK_BLOCK,
    NotZipRecord,
    RecordDamaged,
    check_globals,
    check_record,
)


class _Scratch:
    """One growing byte buffer for the reads that cannot land in their target directly, so
    that each such read does not allocate (and page in) a buffer of its own."""

    def __init__(self):
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(tuple(shape))


def _read_run(stream, record: TensorRecord, first: int, count: int, target: torch.Tensor,
              scratch: _Scratch):
    """Read ``count`` elements from element ``first`` of ``record`` into ``target``: straight
    into its memory when it is a plain, contiguous CPU tensor of the stored dtype, else into a
    tensor in ``scratch``'s buffer and ``target.copy_`` (torch's reader converts the same way).
    A read of the whole storage checks its CRC-32 (:class:`RecordDamaged`), after the bytes
    landed in ``target``: the load fails, and ``recipes``' pre-load verification is what keeps
    the weights untouched."""
    direct = (type(target) is torch.Tensor and target.device.type == "cpu"
              and target.dtype == record.dtype and target.is_contiguous())
    dest = target if direct else scratch.tensor(target.shape, record.dtype)
    # as_strided: a 1-element tensor is contiguous whatever its stride, and view() needs 1.
    flat = dest.as_strided((count,), (1,))
    view = memoryview(flat.view(torch.uint8).numpy()) if count else memoryview(b"")
    stream.seek(record.data_offset + first * record.dtype.itemsize)
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError(f"data file ends {len(view) - done} bytes short of a stored tensor")
        done += got
    if (_CHECK_CRC and first == 0 and len(view) == record.storage_bytes
            and zlib.crc32(view) != record.crc32):
        raise RecordDamaged(
            f"the stored tensor's bytes do not match the CRC-32 of its record "
            f"({zlib.crc32(view):08x}, recorded {record.crc32:08x}): the data file is damaged")
    if not direct:
        target.copy_(dest)


def read_data(reader, plan, planner, stock):
    """``FileSystemReader.read_data`` that reads contiguous runs itself and hands the rest
    to ``stock`` (torch's own ``read_data``, synchronous), one plan per data file.

    Args:
        reader: the ``FileSystemReader`` (its ``storage_data``, ``fs``, ``path``).
        plan: the ``LoadPlan``; planner: the ``LoadPlanner`` (``resolve_tensor``,
            ``commit_tensor``), as torch passes them.
        stock: torch's ``FileSystemReader.read_data``.

    Returns:
        A completed ``torch.futures.Future`` (torch's contract).

    Raises:
        DataFileError: a data file ends inside a tensor it should hold, a record read whole
            does not match its CRC-32s, or a record cannot be read or unpickled (from torch's
            reader too): names the file, and the item read from it where known.
        AssertionError: the target's shape differs from the request's (as torch's reader).
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list[Any]] = {}
    rest = []
    scratch = _Scratch()
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            rest.append(item)
        else:
            per_file.setdefault(info.relative_path, []).append(item)
    for relative_path, items in per_file.items():
        records: dict[tuple[int, int], Optional[TensorRecord]] = {}
        path = reader.fs.concat_path(reader.path, relative_path)
        item = None
        try:
            with reader.fs.create_stream(path, "rb") as stream:
                for item in sorted(items,
                                   key=lambda i: reader.storage_data[i.storage_index].offset):
                    info = reader.storage_data[item.storage_index]
                    key = (info.offset, info.length)
                    if key not in records:
                        try:
                            records[key] = read_record(stream, info.offset, info.length)
                        except ValueError:
                            records[key] = None
                    record = records[key]
                    run = record and contiguous_run(record, item.storage_offsets, item.lengths)
                    if not run:
                        rest.append(item)
                        continue
                    target = planner.resolve_tensor(item).detach()
                    if tuple(target.shape) != tuple(item.lengths):
                        raise AssertionError(  # torch's reader raises the same
                            f"req {item.storage_index} mismatch sizes {target.size()} vs "
                            f"{torch.Size(item.lengths)}")
                    _read_run(stream, record, *run, target, scratch)
                    planner.commit_tensor(item, target)
        except (EOFError, OSError, RecordDamaged) as exc:
            where = "" if item is None else (
                f" ({_describe(item)}, bytes {info.offset} to {info.offset + info.length} of "
                f"the file)")
            raise DataFileError(f"{path}: {exc}{where}") from exc
    # torch's reader, one data file at a time, so that an error names its file; torch reads
    # each of these records whole, so their CRC-32s are checked first.
    by_file: dict[str, list[Any]] = {}
    for item in rest:
        by_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for relative_path, items in by_file.items():
        _check_records(reader, relative_path, items, crc=_CHECK_CRC)
        try:
            stock(reader, dataclasses.replace(plan, items=items), planner).wait()
        except (AssertionError, DataFileError):
            raise
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            path = reader.fs.concat_path(reader.path, relative_path)
            item, error = _failing_item(reader, plan, planner, stock, items, exc)
            raise DataFileError(
                f"{path}: {_error_text(error)} (while reading {_describe(item)} with torch's "
                f"reader)") from error
    from torch.futures import Future

    done: Future = Future()
    done.set_result(None)
    return done


def _check_records(reader, relative_path: str, items, crc: bool = True) -> None:
    """:func:`check_record` for each record of ``items`` in one data file (once per record),
    and for a tensor's record :func:`ckpt.format.zip_records.check_globals` (the globals its pickle
    names, read without unpickling): torch's reader unpickles it with
    ``torch.load(weights_only=True)``, whose list holds classes no checkpoint of this project
    stores (``DeviceMesh``, ``DTensor``). A tensor's record that is no zip archive (torch's
    legacy format: no save writes one) and any record stored through a transform (a torch DCP
    extension: none writes one) are refused; object records go to ``load_bytes``, which
    :mod:`ckpt.format.safe_objects` checks the same way. This holds with
    ``checkpoint.verify_on_load=false`` too. With ``crc`` False (:func:`crc_unchecked`) only the zip structure is checked: a
    compressed entry is refused either way, before torch's reader would inflate it.

    Raises:
        DataFileError: a record is damaged, names a global outside the list or is not a zip
            record (names the file, the item and the entry or global).
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    path = reader.fs.concat_path(reader.path, relative_path)
    done: set[tuple[int, int]] = set()
    buffer = None
    item = info = None
    try:
        with reader.fs.create_stream(path, "rb") as stream:
            for item in items:
                info = reader.storage_data[item.storage_index]
                if (info.offset, info.length) in done:
                    continue
                if info.transform_descriptors:
                    raise RecordDamaged(f"stored through the transforms "
                                        f"{list(info.transform_descriptors)}, which no save "
                                        f"writes: refused before torch's reader")
                done.add((info.offset, info.length))
                buffer = buffer or bytearray(min(_CHECK_BLOCK, max(info.length, 1 << 16)))
                tensor = item.type != LoadItemType.BYTE_IO
                try:
                    check_record(stream, info.offset, info.length, buffer, crc=crc)
                except NotZipRecord as exc:
                    if not tensor:  # an object's bytes go to load_bytes (ckpt.format.safe_objects)
                        continue
                    raise RecordDamaged(f"{exc} (torch.save writes every tensor as one: a torn, "
                                        f"foreign or crafted record): refused before torch's "
                                        f"reader unpickles it") from None
                if tensor:
                    check_globals(stream, info.offset, info.length)
    except (RecordDamaged, OSError) as exc:
        where = "" if item is None else (
            f" ({_describe(item)}, bytes {info.offset} to {info.offset + info.length} of the "
            f"file)")
        raise DataFileError(f"{path}: {exc}{where}") from exc


def _failing_item(reader, plan, planner, stock, items, exc):
    """The first of ``items`` that torch's reader fails on alone, and its error (after a read of
    them all failed with ``exc``; the load fails either way). ``(items[0], exc)`` if none does."""
    if len(items) > 1:
        for item in items:
            try:
                stock(reader, dataclasses.replace(plan, items=[item]), planner).wait()
            except AssertionError:
                raise
            except Exception as error:  # noqa: BLE001 - the one to name
                return item, error
    return items[0], exc


def _error_text(error: BaseException) -> str:
    """``Type: message``, without the advice ``torch.load`` gives for a file its weights-only
    unpickler refuses (to load it with ``weights_only=False``): here the record is damaged."""
    text = str(error)
    if "Weights only load failed" in text:
        found = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", text, re.S)
        detail = " ".join(found.group(1).split()) if found else ""
        text = f"a tensor record that does not unpickle as a tensor ({detail or 'refused'})"
    return f"{type(error).__name__}: {text}"


def _describe(item) -> str:
    """A read item's key and, for a tensor, where its stored chunk starts in the tensor."""
    from torch.distributed.checkpoint.planner import LoadItemType

    index = item.storage_index
    if item.type == LoadItemType.BYTE_IO:
        return f"object {index.fqn!r}"
    return f"tensor {index.fqn!r}, the chunk at {tuple(index.offset or ())}"


_ENABLED = True
_CHECK_CRC = True


@contextlib.contextmanager
def disabled():
    """Within the block, an installed reader hands every request to torch's ``read_data``
    (benchmarks measure both side by side)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = before


@contextlib.contextmanager
def crc_unchecked():
    """Within the block, reads check no CRC-32 (benchmarks measure the check's cost)."""
    global _CHECK_CRC
    before, _CHECK_CRC = _CHECK_CRC, False
    try:
        yield
    finally:
        _CHECK_CRC = before


def install() -> None:
    """Route torch DCP's ``FileSystemReader.read_data`` (megatron's torch_dist load uses it)
    through :func:`read_data`. Idempotent."""
    from torch.distributed.checkpoint import FileSystemReader

    if getattr(FileSystemReader.read_data, "_runs", False):
        return
    stock = FileSystemReader.read_data

    def read_data_runs(self, plan, planner):
        if not _ENABLED:
            return stock(self, plan, planner)
        return read_data(self, plan, planner, stock)

    read_data_runs._runs = True
    read_data_runs.stock = stock  # torch's own
    read_data_runs.__doc__ = read_data.__doc__
    FileSystemReader.read_data = read_data_runs
