"""ckpt.format.dcp_reader and dcp_records: a damaged data file or record is named with the item
that reads it (crc32 of whole storages, the zip directory, a record naming another class),
before torch's own reader unpickles anything."""

from __future__ import annotations

import contextlib
import io
import re
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from ckpt.format import dcp_reader
from dcp_reads import (
    SENTINEL, Planner, file_reader, read, read_item, stored, torch_read_data,
)


def test_a_damaged_data_file_is_named_with_the_item(tmp_path):
    """Each error names the data file and the item: a corrupted object record (read by torch's
    reader), a tensor record overwritten and a file cut inside a tensor (refused before torch's
    reader gets them), and a file that ends inside a tensor once
    its record's headers were read (ours: truncated while the load runs)."""
    import shutil

    state = stored()
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    meta = file_reader(tmp_path / "src").storage_data
    fqn = "fp32"
    info = next(v for k, v in meta.items() if k.fqn == fqn)
    item = read_item(fqn, (0, 0), (96, 40))

    def target():
        return {fqn: torch.full((96, 40), SENTINEL, dtype=torch.float32)}

    def damaged(name, key, cut):
        path = tmp_path / name
        shutil.copytree(tmp_path / "src", path)
        where = next(v for k, v in meta.items() if k.fqn == key)
        data = path / where.relative_path
        raw = bytearray(data.read_bytes())
        if cut == "pkl":  # bytes of the record's data.pkl (after its 30-byte zip header)
            raw[where.offset + 40:where.offset + 80] = b"\xff" * 40
        elif cut:  # the file ends inside the tensor's storage
            raw = raw[: where.offset + where.length // 2]
        else:  # the whole record overwritten
            raw[where.offset:where.offset + where.length] = b"\0" * where.length
        data.write_bytes(bytes(raw))
        return path, data

    path, data = damaged("object", "bytes", cut=False)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: .*\(while reading object 'bytes' with torch's "
                             rf"reader\)"):
        read(path, [read_item("bytes", (), (), LoadItemType.BYTE_IO)], {}, runs=True)
    # An intact object before the damaged tensor: the tensor is named, refused before torch's
    # reader would unpickle it (no zip archive).
    path, data = damaged("tensor", "transposed", cut=False)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: not a zip record: .*refused before torch's reader "
                             rf"unpickles it \(tensor 'transposed', the chunk at \(0, 0\), "):
        read(path, [read_item("bytes", (), (), LoadItemType.BYTE_IO),
                     read_item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    path, data = damaged("cut", fqn, cut=True)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: .*\(tensor '{fqn}', the chunk at \(0, 0\), bytes "):
        read(path, [item], target(), runs=True)

    # A record whose data.pkl bytes were overwritten: its zip header and CRC-32 no longer match,
    # checked before torch's reader gets it.
    path, data = damaged("pkl", "transposed", cut="pkl")
    with pytest.raises(dcp_reader.DataFileError) as refused:
        read(path, [read_item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    assert re.match(rf"{data}: entry archive/data.pkl: its local header does not match the zip "
                    rf"directory .*\(tensor 'transposed', the chunk at \(0, 0\), bytes ",
                    str(refused.value)), str(refused.value)
    # Unchecked CRC-32s, the pickle's opcodes are still read before torch's reader gets it:
    # refused, naming the item, with no advice to load it with weights_only=False (it is
    # damaged, not foreign).
    with dcp_reader.crc_unchecked(), pytest.raises(dcp_reader.DataFileError) as refused:
        read(path, [read_item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    assert re.match(rf"{data}: .*\(tensor 'transposed', the chunk at \(0, 0\), bytes ",
                    str(refused.value)), str(refused.value)
    assert "weights_only" not in str(refused.value)
    # Storage reads (over 4 KiB) find the end of the file: it was cut after the headers were read.
    reader = file_reader(tmp_path / "src", hook=lambda readinto, b: 0 if len(b) > 4096 else readinto(b))
    data = tmp_path / "src" / info.relative_path
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: data file ends 15360 bytes short of a stored tensor "
                             rf"\(tensor '{fqn}', the chunk at \(0, 0\), bytes {info.offset} to "
                             rf"{info.offset + info.length} of the file\)"):
        dcp_reader.read_data(reader, LoadPlan([item]), Planner(target()),
                             torch_read_data())


def _flipped(tmp_path, fqn, where=0.5):
    """A copy of a fresh save with one byte of ``fqn``'s stored bytes flipped (inside its
    storage, or, for an object, inside its record), and that byte's offset in the file."""
    import shutil

    state = stored()
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    path = tmp_path / "flipped"
    shutil.copytree(tmp_path / "src", path)
    info = next(v for k, v in file_reader(path).storage_data.items() if k.fqn == fqn)
    data = path / info.relative_path
    raw = bytearray(data.read_bytes())
    record = io.BytesIO(bytes(raw[info.offset:info.offset + info.length]))
    archive = zipfile.ZipFile(record)
    entry = max(archive.infolist(), key=lambda i: i.file_size)  # the storage (data/0)
    with archive.open(entry) as f:  # zipfile's own reading of where the entry's bytes start
        start = f._fileobj.tell()
    at = info.offset + start + int(entry.file_size * where)
    raw[at] ^= 0x10
    data.write_bytes(bytes(raw))
    return path, data, state, at


def test_a_read_of_a_whole_storage_checks_its_crc32(tmp_path):
    """A flipped bit in a stored tensor fails every read that covers its whole storage (ours:
    the whole tensor; torch's: a strided slice, whose record torch reads whole), naming the file
    and the item; a run of rows that covers part of the storage is not checked (the gap
    ``python -m gtp verify`` closes)."""
    path, data, state, _ = _flipped(tmp_path, "fp32", where=0.9)  # row 86 of 96
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: the stored tensor's bytes do not match the CRC-32 of "
                             rf"its record .*\(tensor 'fp32', the chunk at \(0, 0\), bytes "):
        read(path, [read_item("fp32", (0, 0), (96, 40))],
              {"fp32": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: entry archive/data/0 \(15360 bytes\) does not match its "
                             rf"CRC-32 .*\(tensor 'fp32', the chunk at \(0, 0\), bytes "):
        read(path, [read_item("fp32", (10, 8), (4, 16))],  # a block: torch's reader
              {"fp32": torch.full((4, 16), SENTINEL, dtype=torch.float32)}, runs=True)
    target = torch.full((30, 40), SENTINEL, dtype=torch.float32)
    read(path, [read_item("fp32", (17, 0), (30, 40))], {"fp32": target}, runs=True)
    assert torch.equal(target, state["fp32"][17:47])
    # Unchecked (the benchmarks' switch), the whole tensor loads with the flipped bit.
    target = torch.full((96, 40), SENTINEL, dtype=torch.float32)
    with dcp_reader.crc_unchecked():
        read(path, [read_item("fp32", (0, 0), (96, 40))], {"fp32": target}, runs=True)
    assert not torch.equal(target, state["fp32"])
    assert torch.equal(target[:86], state["fp32"][:86])


def test_records_for_torchs_reader_are_checked_first(tmp_path):
    """A tensor stored strided and an object: torch's reader reads their records whole and
    checks no CRC; ours checks them before it does."""
    for fqn, item, targets in (
            ("transposed", read_item("transposed", (0, 0), (96, 40)),
             {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}),
            ("bytes", read_item("bytes", (), (), LoadItemType.BYTE_IO), {})):
        path, data, _, _ = _flipped(tmp_path / fqn, fqn)
        with pytest.raises(dcp_reader.DataFileError,
                           match=rf"^{data}: entry archive/[\w/.]+ \(\d+ bytes\) does not "
                                 rf"match its CRC-32 .*\({'tensor' if targets else 'object'} "
                                 rf"'{fqn}'"):
            read(path, [item], targets, runs=True)
        if targets:  # torch's reader alone loads the flipped bit
            with dcp_reader.crc_unchecked():
                read(path, [item], targets, runs=True)
            assert (targets[fqn] != stored()[fqn]).sum() == 1


def test_check_record_names_the_entry_and_counts_entries(tmp_path):
    buf = io.BytesIO()
    torch.save(torch.arange(10, dtype=torch.int64), buf)
    blob = bytearray(buf.getvalue())
    framed = b"\0" * 7 + bytes(blob) + b"\0" * 5
    n = dcp_reader.check_record(io.BytesIO(framed), 7, len(blob))
    assert n == len(zipfile.ZipFile(io.BytesIO(bytes(blob))).namelist())
    record = dcp_reader.read_record(io.BytesIO(bytes(blob)), 0, len(blob))
    blob[record.data_offset + 8] ^= 1  # element 1
    with pytest.raises(dcp_reader.RecordDamaged,
                       match=r"^entry archive/data/0 \(80 bytes\) does not match its CRC-32"):
        dcp_reader.check_record(io.BytesIO(bytes(blob)), 0, len(blob), bytearray(16))
    with pytest.raises(ValueError, match="not a zip record"):
        dcp_reader.check_record(io.BytesIO(b"x" * 100), 0, 100)


def test_a_tensor_record_naming_another_class_is_refused_before_torchs_reader(tmp_path):
    """A tensor's record crafted to reduce to ``DeviceMesh("cpu", [0])`` (torch's weights-only
    list holds it once ``torch.distributed.tensor`` is imported; its constructor joins a
    process group) is no plain tensor record, so it goes to torch's reader: its pickle's
    globals are read first and it is refused, naming the class, CRC-32s checked or not
    (``checkpoint.verify_on_load=false`` leaves only this check)."""
    import shutil

    import torch.distributed.tensor  # noqa: F401 - puts DeviceMesh on the weights-only list
    from test_crafted_checkpoint import _Mesh, replace_record

    src = tmp_path / "src"
    dcp.save(stored(), checkpoint_id=str(src), no_dist=True)
    blob = io.BytesIO()
    torch.save(_Mesh(), blob)
    for crc in (True, False):
        path = tmp_path / f"crc{crc}"
        shutil.copytree(src, path)
        replace_record(path, "fp32", blob.getvalue())
        check = contextlib.nullcontext() if crc else dcp_reader.crc_unchecked()
        with check, pytest.raises(dcp_reader.DataFileError,
                                  match=r"torch\.distributed\.device_mesh\.DeviceMesh.*\(tensor "
                                        r"'fp32', the chunk at \(0, 0\), bytes "):
            read(path, [read_item("fp32", (0, 0), (96, 40))],
                  {"fp32": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
