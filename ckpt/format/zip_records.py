"""The zip structure of the ``torch.save`` records in DCP data files, and their CRC-32 check.

A ``torch.save`` record is a zip archive of stored (never compressed) entries, each with the
CRC-32 of its bytes in the zip directory at the record's end. :class:`Window` makes one record
of a data file a file of its own (for ``zipfile``); :func:`check_record` checks every entry of
a record against its CRC-32 (:mod:`ckpt.format.dcp_reader` for the reads that cover whole records,
:mod:`ckpt.verify` for every record of a checkpoint); :func:`check_globals` that its pickle names
only the globals this project's records hold (no ``DeviceMesh``, ``DTensor`` or anything else
torch's weights-only list admits once some module registers it): :func:`check_stored` (every
object load, :mod:`ckpt.format.safe_objects`) runs both, :mod:`ckpt.verify` every record.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickletools
import re
import struct
import zipfile
import zlib
from typing import Optional

# zip local file header (30 bytes): signature, version, flags, method, time, date, crc32,
# compressed size, size, name length, extra length.
LOCAL_HEADER = struct.Struct("<4sHHHHHLLLHH")
LOCAL_SIGNATURE = b"PK\x03\x04"
# zip central directory entry (46 bytes) and end of central directory record (22 bytes).
CENTRAL = struct.Struct("<4sHHHHHHLLLHHHHHLL")
CENTRAL_SIGNATURE = b"PK\x01\x02"
END = struct.Struct("<4sHHHHLLH")
END_SIGNATURE = b"PK\x05\x06"


class RecordDamaged(ValueError):
    """A ``torch.save`` record's bytes do not match the CRC-32s (or the zip structure) its own
    zip directory records: the message names the entry."""


class NotZipRecord(ValueError):
    """A record is no zip archive (torch's legacy format, or damage): no save of this project
    writes one, and torch's reader would unpickle it unchecked."""


class ForbiddenGlobal(RecordDamaged):
    """A record's pickle names a global no checkpoint of this project holds (the message names
    it), or fetches one otherwise: refused before anything unpickles it."""


# The globals (module.name, as python 3 spells them) a record of this project names:
# torch.save's tensor and parameter rebuilds (a stock-format save stores nn.Parameters) and typed
# storages (one per dtype: _STORAGE), dtypes (torch.<dtype>), and the plain values a weights-only
# load builds (bytes are _codecs.encode in protocol 2).
PLAIN_GLOBALS = frozenset({
    "collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state", "torch._tensor._rebuild_from_type_v2",
    "torch.Tensor", "torch.nn.parameter.Parameter", "torch.Size", "torch.device",
    "_codecs.encode", "builtins.set", "builtins.complex", "builtins.bytearray"})
_STORAGE = re.compile(r"torch\.[A-Za-z0-9]+Storage")
# Opcodes that fetch a global other than by GLOBAL (torch's weights-only unpickler refuses them
# too) or create objects protocol 2 never needs.
_REFUSED_OPCODES = frozenset({"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"})
PICKLE_LIMIT = 1 << 30  # bytes of one record's data.pkl scanned at most


def allowed_global(name: str) -> bool:
    """Whether a record may name the global ``name`` (``module.attr``): one of
    :data:`PLAIN_GLOBALS`, a typed storage (``torch.FloatStorage``...) or a dtype
    (``torch.bfloat16``...). torch's weights-only unpickler still resolves what is allowed."""
    if name in PLAIN_GLOBALS or _STORAGE.fullmatch(name):
        return True
    module, _, attr = name.rpartition(".")
    if module != "torch" or not attr.isidentifier():
        return False
    import torch

    return isinstance(getattr(torch, attr, None), torch.dtype)


def _global_name(arg: str) -> str:
    """``module.name`` of a GLOBAL opcode's ``"module name"``, python 2 names mapped as
    torch's unpickler maps them (protocol 2 writes ``__builtin__.set``)."""
    module, _, name = arg.partition(" ")
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def check_globals(stream, offset: int, length: int) -> None:
    """Check that every global each pickle (``*.pkl`` entry) of the ``torch.save`` record at
    ``stream[offset:offset + length]`` names is :func:`allowed_global`. Nothing is unpickled:
    the opcodes are read (``pickletools.genops``).

    Raises:
        ForbiddenGlobal: a global outside the list (named), an opcode that fetches one
            otherwise, a malformed pickle or none at all.
        NotZipRecord: the bytes are no zip archive.
    """
    try:
        archive = zipfile.ZipFile(Window(stream, offset, length))
        pickles = [i for i in archive.infolist() if i.filename.endswith(".pkl")]
    except (zipfile.BadZipFile, EOFError, OSError, struct.error) as exc:
        raise NotZipRecord(f"not a zip record: {exc}") from None
    if not pickles:
        raise ForbiddenGlobal("holds no pickle (data.pkl)")
    for info in pickles:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > min(length,
                                                                           PICKLE_LIMIT):
            _stored(info, length)
            raise ForbiddenGlobal(f"has a {info.file_size}-byte {info.filename}")
        try:
            with archive.open(info) as f:
                ops = [(op.name, arg) for op, arg, _ in pickletools.genops(f.read())]
        except (ValueError, zipfile.BadZipFile, EOFError, OSError) as exc:
            raise ForbiddenGlobal(f"is not plain data a weights-only unpickler reads "
                                  f"({exc})") from None
        for op, arg in ops:
            if op in _REFUSED_OPCODES:
                raise ForbiddenGlobal(f"uses pickle opcode {op}, which no checkpoint object needs")
            if op == "GLOBAL" and not allowed_global(_global_name(arg)):
                raise ForbiddenGlobal(
                    f"names {_global_name(arg)}, which no checkpoint of this project holds (its "
                    f"records hold tensors, dtypes and plain python values only)")


class Window(io.RawIOBase):
    """``stream[offset : offset + length]`` as a seekable file (zipfile seeks from its end)."""

    def __init__(self, stream, offset: int, length: int):
        super().__init__()
        self._stream, self._offset, self._length, self._pos = stream, offset, length, 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=os.SEEK_SET):
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer):
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._stream.seek(self._offset + self._pos)
        got = self._stream.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


CHECK_BLOCK = 16 << 20  # bytes per read of an entry whose CRC-32 is checked


def _stored(info, length: int) -> None:
    """Refuse a compressed entry, or one whose size exceeds the record's ``length``."""
    if info.compress_type != zipfile.ZIP_STORED:  # torch.save never compresses
        raise RecordDamaged(f"entry {info.filename} is compressed (zip method "
                            f"{info.compress_type}; torch.save stores every entry): refused "
                            f"before it is inflated (a crafted or foreign record)")
    if info.file_size != info.compress_size or info.file_size > length:
        raise RecordDamaged(f"entry {info.filename}: {info.file_size} bytes, stored in "
                            f"{info.compress_size}, in a record of {length}: refused")


def check_stored(stream, offset: int, length: int) -> int:
    """Check that every entry of the zip record at ``stream[offset:offset + length]`` is
    stored uncompressed (zip method 0 in both its directory entry and its local header) and
    no larger than the record: what ``torch.save`` writes, and what ``torch.load`` can read
    without inflating anything; and that its pickle names only :func:`allowed_global`'s
    globals (:func:`check_globals`). Reads the zip directory, the local headers and the
    pickle's opcodes only.

    Returns:
        The number of entries.

    Raises:
        RecordDamaged: an entry is compressed or too large (named); ForbiddenGlobal, its
            subclass: a global outside the list.
        NotZipRecord (a ValueError): the bytes are no zip archive.
    """
    entries = check_record(stream, offset, length, crc=False)
    check_globals(stream, offset, length)
    return entries


def check_record(stream, offset: int, length: int, buffer: Optional[bytearray] = None,
                 crc: bool = True) -> int:
    """Check every entry of the ``torch.save`` record at ``stream[offset:offset + length]``
    against the CRC-32 its zip directory records (zip64 included, through ``zipfile``), and
    that each is stored uncompressed (a compressed entry is refused, never inflated).

    Besides the entries' bytes, each local header's signature and name must match the
    directory's, and every entry must lie inside the record. Not compared: the alignment
    padding of the local headers and the data descriptors' copies of CRC and sizes (no reader
    uses either).

    Args:
        stream: a binary, seekable file object (a DCP data file).
        offset, length: the record's place in it, in bytes.
        buffer: a reused read buffer (allocated when None).
        crc: False to check only that every entry is stored and inside the record (directory
            and local headers' methods and sizes), not the entries' bytes or names.

    Returns:
        The number of entries checked.

    Raises:
        RecordDamaged: an entry's bytes or header do not match (names the entry), an entry is
            compressed or larger than the record, or the record ends inside an entry.
        NotZipRecord (a ValueError): the bytes are no zip archive (e.g. an object a foreign
            writer stored raw): nothing to check them against.
    """
    try:
        infos = zipfile.ZipFile(Window(stream, offset, length)).infolist()
    except (zipfile.BadZipFile, EOFError, OSError, struct.error) as exc:
        raise NotZipRecord(f"not a zip record: {exc}") from None
    for info in infos:
        _stored(info, length)
    if crc:
        buffer = buffer if buffer is not None else bytearray(min(CHECK_BLOCK, max(length, 1)))
        view = memoryview(buffer)
    for info in infos:
        name = info.filename
        stream.seek(offset + info.header_offset)
        header = stream.read(LOCAL_HEADER.size)
        if len(header) < LOCAL_HEADER.size:
            raise RecordDamaged(f"entry {name}: the record ends inside its local header")
        fields = LOCAL_HEADER.unpack(header)
        local_name = stream.read(fields[-2])
        if not crc and fields[0] != LOCAL_SIGNATURE:
            continue  # damaged, not compressed: left to the reader (which refuses it)
        if crc and (fields[0] != LOCAL_SIGNATURE or local_name != info.orig_filename.encode(
                "utf-8" if info.flag_bits & 0x800 else "cp437")):
            raise RecordDamaged(f"entry {name}: its local header does not match the zip "
                                f"directory (signature {fields[0]!r}, name {local_name[:60]!r})")
        if fields[3] != zipfile.ZIP_STORED:
            raise RecordDamaged(f"entry {name}: its local header says zip method {fields[3]} "
                                f"(torch.save stores every entry): refused before it is "
                                f"inflated (a crafted or foreign record)")
        start = info.header_offset + LOCAL_HEADER.size + fields[-2] + fields[-1]
        if start + info.compress_size > length:
            raise RecordDamaged(f"entry {name}: bytes {start} to {start + info.compress_size} "
                                f"of the record, which has {length}")
        if not crc:
            continue
        stream.seek(offset + start)
        crc, left = 0, info.compress_size
        while left:
            got = stream.readinto(view[:min(left, len(view))])
            if not got:
                raise RecordDamaged(f"entry {name}: the data file ends {left} bytes short of it")
            crc = zlib.crc32(view[:got], crc)
            left -= got
        if crc != info.CRC:
            raise RecordDamaged(f"entry {name} ({info.compress_size} bytes) does not match its "
                                f"CRC-32 ({crc:08x}, recorded {info.CRC:08x})")
    return len(infos)
