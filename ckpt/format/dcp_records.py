"""One tensor record of a torch DCP data file, read without unpickling anything that runs code.

The ``torch.save`` record is a zip archive (stored, never compressed) holding ``data.pkl`` and
one ``data/<key>`` entry per storage. ``data.pkl`` is unpickled by a restricted unpickler that
knows only ``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` and the typed
storage classes, and returns the tensor's storage key, dtype, offset, size and stride
(:class:`TensorRecord`, :func:`read_record`); :func:`contiguous_run` says which run of the
stored elements a request covers. :mod:`ckpt.format.dcp_reader` reads the bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import pickle
import struct
import sys
import zipfile
import zlib
from typing import Optional

import torch

from ckpt.format.zip_records import (
    CENTRAL as _CENTRAL,
    CENTRAL_SIGNATURE as _CENTRAL_SIGNATURE,
    END as _END,
    END_SIGNATURE as _END_SIGNATURE,
    LOCAL_HEADER as _LOCAL_HEADER,
    LOCAL_SIGNATURE as _LOCAL_SIGNATURE,
    Window as _Window,
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
