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
:mod:`gtp.verify` checks every byte of a checkpoint before a load (``docs/integrity.md``).

The ``torch.save`` record is a zip archive (stored, never compressed) holding ``data.pkl`` and
one ``data/<key>`` entry per storage. ``data.pkl`` is unpickled by a restricted unpickler that
knows only ``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` and the typed
storage classes, and returns the tensor's storage key, dtype, offset, size and stride; nothing
in the file runs code.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import math
import pickle
import re
import struct
import sys
import zipfile
import zlib
from typing import Any, Optional

import torch

from gtp.zip_records import (  # noqa: F401 - RecordDamaged, check_record: part of this API
    CENTRAL as _CENTRAL,
    CENTRAL_SIGNATURE as _CENTRAL_SIGNATURE,
    CHECK_BLOCK as _CHECK_BLOCK,
    END as _END,
    END_SIGNATURE as _END_SIGNATURE,
    LOCAL_HEADER as _LOCAL_HEADER,
    LOCAL_SIGNATURE as _LOCAL_SIGNATURE,
    RecordDamaged,
    Window as _Window,
    check_record,
)

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_HEAD_BYTES = 4096  # a record's first (last) bytes: data.pkl and byteorder (its directory)


class DataFileError(ValueError):
    """Reading a DCP data file failed (it is torn, truncated or corrupted, or an object in it
    cannot be loaded here): the message names the file, and the item where one is known."""


class _Unsupported(Exception):
    """The record is not one plain tensor this reader handles; torch's reader takes it."""


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where a ``torch.save``d tensor's elements lie inside a DCP data file.

    Attributes:
        data_offset: byte offset, in the data file, of the tensor's storage (its element 0).
        storage_bytes: the storage's size in bytes.
        dtype: element dtype.
        storage_offset: offset of the tensor's first element in its storage (elements).
        size, stride: the tensor's shape and strides (elements).
        crc32: the CRC-32 the record's zip directory holds for the storage's bytes.
    """

    data_offset: int
    storage_bytes: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    crc32: int = 0


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None,
             metadata=None):
    if not isinstance(storage, _Storage) or hooks or metadata:
        raise _Unsupported("tensor with hooks or metadata")
    return (storage, int(storage_offset), tuple(size), tuple(stride))


class _RecordUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype)):
            raise _Unsupported(f"persistent id {pid!r}")
        return _Storage(key=str(pid[2]), dtype=pid[1], numel=int(pid[4]))


def read_record(stream, offset: int, length: int) -> TensorRecord:
    """Locate the one tensor of the ``torch.save`` record at ``stream[offset:offset + length]``.

    The record's last bytes (its zip central directory) and first bytes (``data.pkl``,
    ``byteorder`` and the local headers) are read once each; a record that does not fit them
    (zip64, a large ``data.pkl``) is read through ``zipfile`` instead.

    Args:
        stream: a binary, seekable file object (a DCP ``.distcp`` data file).
        offset, length: the record's place in it, in bytes (DCP's ``_StorageInfo``).

    Returns:
        The :class:`TensorRecord`; reads the record's zip headers, ``data.pkl`` and
        ``byteorder``, never its storage.

    Raises:
        ValueError: the record is not one plain, stored (uncompressed), little-endian tensor on
            a little-endian machine, or its storage entry is missing or too short.
    """
    try:
        if sys.byteorder != "little":
            raise _Unsupported("not a little-endian machine")
        try:
            return _read_ends(stream, offset, length)
        except _Unsupported:
            return _read_directory(stream, offset, length)
    except (_Unsupported, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, KeyError,
            struct.error, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a plain torch.save tensor record: {exc}") from None


@functools.lru_cache(maxsize=1024)  # tensors of one shape and dtype: the same data.pkl
def _parse_pkl(data: bytes):
    rebuilt = _RecordUnpickler(io.BytesIO(data)).load()
    if not isinstance(rebuilt, tuple) or len(rebuilt) != 4:
        raise _Unsupported("not one tensor")
    return rebuilt


def _record(offset, length, data_offset, data_size, rebuilt, crc32: int = 0) -> TensorRecord:
    storage, storage_offset, size, stride = rebuilt
    if data_size < storage.numel * storage.dtype.itemsize or data_offset + data_size > length:
        raise _Unsupported("storage entry too short")
    # torch.load refuses a tensor that does not lie inside its storage.
    if storage_offset < 0 or any(n < 0 for n in size) or any(t < 0 for t in stride) or (
            math.prod(size) and storage_offset + sum((n - 1) * t for n, t in zip(size, stride))
            >= storage.numel):
        raise _Unsupported("tensor outside its storage")
    return TensorRecord(offset + data_offset, data_size, storage.dtype, storage_offset, size,
                        stride, crc32)


def _read_ends(stream, offset: int, length: int) -> TensorRecord:
    """The record's central directory (in its last bytes) and its first bytes, read once each."""
    tail_len = min(length, _HEAD_BYTES)
    stream.seek(offset + length - tail_len)
    tail = stream.read(tail_len)
    end = tail.rfind(_END_SIGNATURE)
    if end < 0 or len(tail) - end < _END.size:
        raise _Unsupported("no end of central directory in the record's last bytes")
    _, _, _, _, count, cd_size, cd_offset, _ = _END.unpack_from(tail, end)
    pos = cd_offset - (length - tail_len)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF or pos < 0 or pos + cd_size > end:
        raise _Unsupported("zip64 or a central directory larger than the last bytes read")
    entries = {}
    for _ in range(count):
        (signature, _, _, _, method, _, _, crc, size, _, name_len, extra_len, comment_len,
         _, _, _, header) = _CENTRAL.unpack_from(tail, pos)
        if signature != _CENTRAL_SIGNATURE or 0xFFFFFFFF in (size, header):
            raise _Unsupported("zip64 entry")
        if method == zipfile.ZIP_STORED:
            name = tail[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len].decode()
            entries[name] = (header, size, crc)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    stream.seek(offset)
    head = stream.read(min(length, _HEAD_BYTES))

    def read(start, size):
        if start + size > len(head):
            raise _Unsupported("an entry beyond the record's first bytes")
        return head[start:start + size]

    return _locate(entries, read, offset, length)


def _read_directory(stream, offset: int, length: int) -> TensorRecord:
    """The same through ``zipfile`` (zip64, entries anywhere in the record)."""
    window = _Window(stream, offset, length)
    entries = {info.filename: (info.header_offset, info.file_size, info.CRC)
               for info in zipfile.ZipFile(window).infolist()
               if info.compress_type == zipfile.ZIP_STORED}

    def read(start, size):
        window.seek(start)
        data = window.read(size)
        if len(data) != size:
            raise _Unsupported("an entry beyond the record")
        return data

    return _locate(entries, read, offset, length)


def _locate(entries: dict[str, tuple[int, int]], read, offset: int, length: int) -> TensorRecord:
    """The tensor record from a record's stored (uncompressed) zip entries.

    Args:
        entries: entry name -> (local header offset, size, CRC-32), offsets within the record.
        read: ``read(start, size)`` -> those bytes of the record.
    """
    def span(name):  # (start, size) of an entry's bytes, after its local header
        header, size, _ = entries[name]
        fields = _LOCAL_HEADER.unpack(read(header, _LOCAL_HEADER.size))
        if fields[0] != _LOCAL_SIGNATURE:
            raise _Unsupported("bad local header")
        return header + _LOCAL_HEADER.size + fields[-2] + fields[-1], size

    def whole(name):  # an entry read whole: its CRC-32 checked
        data = read(*span(name))
        if zlib.crc32(data) != entries[name][2]:
            raise _Unsupported(f"{name} does not match its CRC-32")
        return data

    pkl = next((n for n in entries if n.endswith("/data.pkl")), None)
    if pkl is None:
        raise _Unsupported("no stored data.pkl")
    prefix = pkl[: -len("data.pkl")]
    if prefix + "byteorder" in entries and whole(prefix + "byteorder").strip() != b"little":
        raise _Unsupported("not little-endian")
    rebuilt = _parse_pkl(whole(pkl))
    storage = f"{prefix}data/{rebuilt[0].key}"
    if storage not in entries:
        raise _Unsupported(f"storage {rebuilt[0].key} missing or compressed")
    return _record(offset, length, *span(storage), rebuilt, entries[storage][2])


def contiguous_run(record: TensorRecord, offsets, lengths) -> Optional[tuple[int, int]]:
    """The ``(first element, count)`` of ``record``'s storage that ``tensor[offsets:+lengths]``
    covers, when that slice is one contiguous run of a row-major tensor; else None (also for a
    slice outside the tensor: torch's reader raises on it).

    A run: with k the last dim the slice does not take whole, every dim before k has length 1
    (e.g. a block of rows, or part of one row).
    """
    size, stride = record.size, record.stride
    if len(offsets) != len(size) or len(lengths) != len(size):
        return None
    if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, size)):
        return None
    expected = 1
    for dim in reversed(range(len(size))):  # row-major strides (size-1 dims may have any)
        if size[dim] != 1 and stride[dim] != expected:
            return None
        expected *= size[dim]
    partial = [d for d in range(len(size)) if lengths[d] != size[d]]
    if partial and any(lengths[d] != 1 for d in range(partial[-1])):
        return None
    first = record.storage_offset + sum(o * s for o, s in zip(offsets, stride) if o)
    count = math.prod(lengths)
    if count and (first + count) * record.dtype.itemsize > record.storage_bytes:
        return None
    return first, count


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
    """:func:`check_record` for each record of ``items`` in one data file (once per record);
    a record that is no zip archive (an object stored raw) is left to torch's reader. With
    ``crc`` False (:func:`crc_unchecked`) only the zip structure is checked: a compressed entry
    is refused either way, before torch's reader would inflate it.

    Raises:
        DataFileError: a record is damaged (names the file, the item and the entry).
    """
    path = reader.fs.concat_path(reader.path, relative_path)
    done: set[tuple[int, int]] = set()
    buffer = None
    item = info = None
    try:
        with reader.fs.create_stream(path, "rb") as stream:
            for item in items:
                info = reader.storage_data[item.storage_index]
                if info.transform_descriptors or (info.offset, info.length) in done:
                    continue
                done.add((info.offset, info.length))
                buffer = buffer or bytearray(min(_CHECK_BLOCK, max(info.length, 1 << 16)))
                try:
                    check_record(stream, info.offset, info.length, buffer, crc=crc)
                except RecordDamaged:
                    raise
                except ValueError:
                    continue
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
