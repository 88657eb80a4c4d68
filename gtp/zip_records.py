"""The zip structure of the ``torch.save`` records in DCP data files, and their CRC-32 check.

A ``torch.save`` record is a zip archive of stored (never compressed) entries, each with the
CRC-32 of its bytes in the zip directory at the record's end. :class:`Window` makes one record
of a data file a file of its own (for ``zipfile``); :func:`check_record` checks every entry of
a record against its CRC-32 (:mod:`gtp.dcp_reader` for the reads that cover whole records,
:mod:`gtp.verify` for every record of a checkpoint).
"""

from __future__ import annotations

import io
import os
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
    without inflating anything. Reads the zip directory and the local headers only.

    Returns:
        The number of entries.

    Raises:
        RecordDamaged: an entry is compressed or too large (named).
        ValueError: the bytes are no zip archive.
    """
    return check_record(stream, offset, length, crc=False)


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
        ValueError: the bytes are no zip archive (e.g. an object a foreign writer stored raw):
            nothing to check them against.
    """
    try:
        infos = zipfile.ZipFile(Window(stream, offset, length)).infolist()
    except (zipfile.BadZipFile, EOFError, OSError, struct.error) as exc:
        raise ValueError(f"not a zip record: {exc}") from None
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
