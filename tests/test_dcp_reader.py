"""ckpt.format.dcp_reader: a DCP read request that covers a run of a stored tensor's rows reads those
bytes only, and every request reads the same values as torch's own reader."""

from __future__ import annotations

import contextlib
import io
import re
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckpt.format import dcp_reader, dcp_records

SENTINEL = -7


def _stored():
    """Independent goldens: what is saved, built with plain torch."""
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(96, 40, generator=g),
        "bf16": torch.randn(1, 1, 64, 24, generator=g).to(torch.bfloat16),
        "int64": torch.arange(50, dtype=torch.int64),
        "fp32_3d": torch.randn(4, 10, 8, generator=g),  # e.g. experts x rows x cols
        # Saved as a strided view of a (40, 96) storage: not a run of rows; torch reads it.
        "transposed": torch.randn(40, 96, generator=g).t(),
        "bytes": io.BytesIO(b"not a tensor"),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp")
    state = _stored()
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, state


class _Planner:
    """resolve_tensor hands out sentinel-filled targets; commit_tensor records them."""

    def __init__(self, targets):
        self.targets, self.committed = targets, {}

    def resolve_tensor(self, item):
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item, tensor):
        self.committed[item.dest_index.fqn] = tensor

    def load_bytes(self, item, value):
        self.committed[item.dest_index.fqn] = torch.load(value, weights_only=False).getvalue()


def _item(fqn, offsets, lengths, kind=LoadItemType.TENSOR):
    zero = torch.Size([0] * len(offsets))
    index = MetadataIndex(fqn, None if kind == LoadItemType.BYTE_IO else zero)
    return ReadItem(type=kind, dest_index=index, dest_offsets=zero,
                    storage_index=index, storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths))


class _Stream(io.RawIOBase):
    """A data file's stream whose ``readinto`` goes through ``hook(inner_readinto, buffer)``."""

    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, *a):
        return self.inner.seek(*a)

    def tell(self):
        return self.inner.tell()

    def readinto(self, b):
        return self.hook(self.inner.readinto, b)


def _reader(path, counter=None, hook=None):
    """A FileSystemReader of ``path``; ``counter``: counts the bytes read from the data files;
    ``hook``: wraps each data file stream's ``readinto`` (see :class:`_Stream`)."""
    reader = FileSystemReader(str(path))
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    if counter is not None:
        def counting(readinto, b):
            n = readinto(b)
            counter[0] += n
            return n
        hook = counting
    if hook is not None:
        create_stream = reader.fs.create_stream

        class Wrapped:
            def __init__(self, *a):
                self.cm = create_stream(*a)

            def __enter__(self):
                return io.BufferedReader(_Stream(self.cm.__enter__(), hook), buffer_size=512)

            def __exit__(self, *exc):
                return self.cm.__exit__(*exc)

        reader.fs.create_stream = Wrapped
    return reader


def _torch_read_data():
    """torch's own ``FileSystemReader.read_data``, whether or not an earlier test (or a load in
    this process) installed the project's reader."""
    read_data = FileSystemReader.read_data
    return getattr(read_data, "stock", read_data)


def _read(path, items, targets, runs, counter=None):
    reader = _reader(path, counter)
    planner = _Planner(targets)
    plan = LoadPlan(items)
    stock = _torch_read_data()
    if runs:
        dcp_reader.read_data(reader, plan, planner, stock).wait()
    else:
        stock(reader, plan, planner).wait()
    return planner.committed


CASES = [  # (fqn, offsets, lengths)
    ("fp32", (17, 0), (30, 40)),          # a run of rows
    ("fp32", (0, 0), (96, 40)),           # the whole tensor
    ("fp32", (95, 0), (1, 40)),           # the last row
    ("fp32", (5, 0), (0, 40)),            # no rows (a rank holding only padding)
    ("fp32", (3, 8), (1, 16)),            # part of one row: one run
    ("fp32", (10, 8), (4, 16)),           # a block: strided, torch reads it
    ("bf16", (0, 0, 9, 0), (1, 1, 40, 24)),
    ("int64", (7,), (20,)),
    ("fp32_3d", (2, 3, 0), (1, 5, 8)),    # rows of one expert: one run
    ("fp32_3d", (1, 3, 0), (2, 5, 8)),    # rows of two experts: strided, torch reads it
    ("transposed", (10, 0), (20, 40)),    # stored strided: torch reads it
]
RUNS = {0, 1, 2, 3, 4, 6, 7, 8}  # indices of CASES that are one contiguous run


@pytest.mark.parametrize("fqn, offsets, lengths", CASES)
def test_reads_exactly_the_requested_slice(checkpoint, fqn, offsets, lengths):
    path, state = checkpoint
    want = state[fqn][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    for runs in (True, False):
        target = torch.full(lengths, SENTINEL, dtype=state[fqn].dtype)
        got = _read(path, [_item(fqn, offsets, lengths)], {fqn: target}, runs)
        assert got[fqn].data_ptr() == target.data_ptr() or not target.numel()
        assert torch.equal(target, want), (fqn, runs)


def _records(path):
    reader = _reader(path)
    out = {}
    for index, info in reader.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            try:
                out[index.fqn] = dcp_reader.read_record(f, info.offset, info.length)
            except ValueError:
                out[index.fqn] = None
    return out


def test_which_requests_are_runs(checkpoint):
    path, _ = checkpoint
    records = _records(path)
    assert records["transposed"] is not None and records["bytes"] is None
    for i, (fqn, offsets, lengths) in enumerate(CASES):
        run = dcp_reader.contiguous_run(records[fqn], offsets, lengths)
        assert (run is not None) == (i in RUNS), (fqn, offsets, lengths, run)
    # Outside the tensor: no run (torch's reader raises on it).
    assert dcp_reader.contiguous_run(records["fp32"], (90, 0), (10, 40)) is None
    assert dcp_reader.contiguous_run(records["fp32"], (-1, 0), (1, 40)) is None


def test_a_one_element_target_with_any_stride_is_filled(checkpoint):
    path, state = checkpoint
    live = torch.full((4,), SENTINEL, dtype=torch.int64)
    target = live[::2][:1]  # contiguous (one element), stride 2
    _read(path, [_item("int64", (7,), (1,))], {"int64": target}, runs=True)
    assert live.tolist() == [7, SENTINEL, SENTINEL, SENTINEL]


def test_a_record_whose_tensor_leaves_its_storage_is_refused():
    storage = dcp_records._Storage(key="0", dtype=torch.float32, numel=24)
    for offset, size, stride in ((-2, (3,), (1,)), (0, (10, 4), (4, 1)), (20, (5,), (1,))):
        with pytest.raises(dcp_records._Unsupported, match="outside its storage"):
            dcp_records._record(0, 1000, 0, 96, (storage, offset, size, stride))
    assert dcp_records._record(0, 1000, 0, 96, (storage, 0, (6, 4), (4, 1))).size == (6, 4)


def test_a_run_of_rows_reads_those_bytes_only(checkpoint):
    path, state = checkpoint
    rows = 30
    want_bytes = rows * 40 * 4
    counts = {}
    for runs in (True, False):
        counter = [0]
        target = torch.full((rows, 40), SENTINEL, dtype=torch.float32)
        _read(path, [_item("fp32", (17, 0), (rows, 40))], {"fp32": target}, runs, counter)
        assert torch.equal(target, state["fp32"][17:17 + rows])
        counts[runs] = counter[0]
    # torch's reader reads the whole stored chunk (96 rows); ours the 30 rows plus the
    # record's zip directory, data.pkl and a few 512-byte buffer fills around them.
    assert counts[False] >= 96 * 40 * 4
    assert want_bytes <= counts[True] <= want_bytes + 8 * 1024, counts


def test_non_contiguous_and_other_dtype_targets_are_filled_by_copy(checkpoint):
    """Through one scratch buffer, reused from read to read in a plan (each read of its own
    size): every target gets its own values."""
    path, state = checkpoint
    live = torch.full((30, 80), SENTINEL, dtype=torch.float64)
    target = live[:, ::2]  # strided, and float64 where float32 is stored: torch's copy_ rules
    live_3d = torch.full((5, 16), SENTINEL, dtype=torch.float32)
    target_3d = live_3d[:, 4:12].unsqueeze(0)  # a column slice, like a TP split on dim 1
    live_int = torch.full((20, 2), SENTINEL, dtype=torch.int64)
    items = [_item("fp32", (17, 0), (30, 40)), _item("fp32_3d", (2, 3, 0), (1, 5, 8)),
             _item("int64", (7,), (20,))]
    _read(path, items, {"fp32": target, "fp32_3d": target_3d, "int64": live_int[:, 1]},
          runs=True)
    assert torch.equal(target, state["fp32"][17:47].double())
    assert (live[:, 1::2] == SENTINEL).all()
    assert torch.equal(target_3d, state["fp32_3d"][2:3, 3:8])
    assert (live_3d[:, :4] == SENTINEL).all() and (live_3d[:, 12:] == SENTINEL).all()
    assert torch.equal(live_int[:, 1], state["int64"][7:27])
    assert (live_int[:, 0] == SENTINEL).all()


def test_object_items_and_mixed_plans_go_through_torch(checkpoint):
    path, state = checkpoint
    items = [_item("bytes", (), (), LoadItemType.BYTE_IO), _item("int64", (7,), (20,)),
             _item("transposed", (0, 0), (96, 40))]
    targets = {"int64": torch.full((20,), SENTINEL, dtype=torch.int64),
               "transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}
    got = _read(path, items, targets, runs=True)
    assert got["bytes"] == b"not a tensor"
    assert torch.equal(targets["int64"], state["int64"][7:27])
    assert torch.equal(targets["transposed"], state["transposed"])


def test_wrong_target_shape_is_refused(checkpoint):
    path, _ = checkpoint
    with pytest.raises(AssertionError, match="mismatch sizes"):
        _read(path, [_item("fp32", (0, 0), (10, 40))],
              {"fp32": torch.zeros(11, 40)}, runs=True)


def test_record_parser_refuses_what_is_not_one_plain_tensor(tmp_path):
    buf = io.BytesIO()
    torch.save({"a": torch.zeros(3)}, buf)
    data = buf.getvalue()
    for blob in (data, b"garbage" * 10):
        with pytest.raises(ValueError, match="not a plain torch.save tensor record"):
            dcp_reader.read_record(io.BytesIO(blob), 0, len(blob))


def test_install_routes_torch_reader_and_is_idempotent():
    dcp_reader.install()
    first = FileSystemReader.read_data
    dcp_reader.install()
    assert FileSystemReader.read_data is first and first._runs
    assert not getattr(first.stock, "_runs", False)  # torch's own, kept for its other requests


def _zip_record(order):
    """A torch.save record rewritten with its zip entries in ``order`` (names' last parts)."""
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.arange(24, dtype=torch.float32).view(6, 4), buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    entries = {n.split("/", 1)[1]: source.read(n) for n in source.namelist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in order + [n for n in entries if n not in order]:
            archive.writestr("archive/" + name, entries[name])
    return out.getvalue()


def test_records_in_another_zip_order_are_read_through_the_directory():
    """Both parsers (the record's two ends; zipfile's directory) find the same storage, and a
    record whose data.pkl is not near its start (so the first fails) still reads exactly."""
    want = torch.arange(24, dtype=torch.float32).view(6, 4)
    padding = {"big": "x" * 8192}  # pushes data.pkl beyond the record's first bytes
    for order in (["data.pkl", "byteorder", "data/0"], ["data/0", "byteorder", "data.pkl"]):
        blob = _zip_record(order)
        if order[0] == "data/0":
            import zipfile

            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
                archive.writestr("archive/padding", padding["big"])
                for name in zipfile.ZipFile(io.BytesIO(blob)).namelist():
                    archive.writestr(name, zipfile.ZipFile(io.BytesIO(blob)).read(name))
            blob = out.getvalue()
            with pytest.raises(dcp_records._Unsupported):
                dcp_records._read_ends(io.BytesIO(blob), 0, len(blob))
        else:
            assert dcp_records._read_ends(io.BytesIO(blob), 0, len(blob)) == \
                dcp_records._read_directory(io.BytesIO(blob), 0, len(blob))
        framed = b"\0" * 100 + blob + b"\0" * 50  # a record inside a larger data file
        record = dcp_reader.read_record(io.BytesIO(framed), 100, len(blob))
        first, count = dcp_reader.contiguous_run(record, (2, 0), (3, 4))
        target = torch.full((3, 4), SENTINEL, dtype=torch.float32)
        dcp_reader._read_run(io.BytesIO(framed), record, first, count, target,
                              dcp_reader._Scratch())
        assert torch.equal(target, want[2:5])


def test_a_damaged_data_file_is_named_with_the_item(tmp_path):
    """Each error names the data file and the item: a corrupted object record (read by torch's
    reader), a tensor record overwritten and a file cut inside a tensor (refused before torch's
    reader gets them), and a file that ends inside a tensor once
    its record's headers were read (ours: truncated while the load runs)."""
    import shutil

    state = _stored()
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    meta = _reader(tmp_path / "src").storage_data
    fqn = "fp32"
    info = next(v for k, v in meta.items() if k.fqn == fqn)
    item = _item(fqn, (0, 0), (96, 40))

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
        _read(path, [_item("bytes", (), (), LoadItemType.BYTE_IO)], {}, runs=True)
    # An intact object before the damaged tensor: the tensor is named, refused before torch's
    # reader would unpickle it (no zip archive).
    path, data = damaged("tensor", "transposed", cut=False)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: not a zip record: .*refused before torch's reader "
                             rf"unpickles it \(tensor 'transposed', the chunk at \(0, 0\), "):
        _read(path, [_item("bytes", (), (), LoadItemType.BYTE_IO),
                     _item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    path, data = damaged("cut", fqn, cut=True)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: .*\(tensor '{fqn}', the chunk at \(0, 0\), bytes "):
        _read(path, [item], target(), runs=True)

    # A record whose data.pkl bytes were overwritten: its zip header and CRC-32 no longer match,
    # checked before torch's reader gets it.
    path, data = damaged("pkl", "transposed", cut="pkl")
    with pytest.raises(dcp_reader.DataFileError) as refused:
        _read(path, [_item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    assert re.match(rf"{data}: entry archive/data.pkl: its local header does not match the zip "
                    rf"directory .*\(tensor 'transposed', the chunk at \(0, 0\), bytes ",
                    str(refused.value)), str(refused.value)
    # Unchecked CRC-32s, the pickle's opcodes are still read before torch's reader gets it:
    # refused, naming the item, with no advice to load it with weights_only=False (it is
    # damaged, not foreign).
    with dcp_reader.crc_unchecked(), pytest.raises(dcp_reader.DataFileError) as refused:
        _read(path, [_item("transposed", (0, 0), (96, 40))],
              {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    assert re.match(rf"{data}: .*\(tensor 'transposed', the chunk at \(0, 0\), bytes ",
                    str(refused.value)), str(refused.value)
    assert "weights_only" not in str(refused.value)
    # Storage reads (over 4 KiB) find the end of the file: it was cut after the headers were read.
    reader = _reader(tmp_path / "src", hook=lambda readinto, b: 0 if len(b) > 4096 else readinto(b))
    data = tmp_path / "src" / info.relative_path
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: data file ends 15360 bytes short of a stored tensor "
                             rf"\(tensor '{fqn}', the chunk at \(0, 0\), bytes {info.offset} to "
                             rf"{info.offset + info.length} of the file\)"):
        dcp_reader.read_data(reader, LoadPlan([item]), _Planner(target()),
                             _torch_read_data())


def _flipped(tmp_path, fqn, where=0.5):
    """A copy of a fresh save with one byte of ``fqn``'s stored bytes flipped (inside its
    storage, or, for an object, inside its record), and that byte's offset in the file."""
    import shutil

    state = _stored()
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    path = tmp_path / "flipped"
    shutil.copytree(tmp_path / "src", path)
    info = next(v for k, v in _reader(path).storage_data.items() if k.fqn == fqn)
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
        _read(path, [_item("fp32", (0, 0), (96, 40))],
              {"fp32": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
    with pytest.raises(dcp_reader.DataFileError,
                       match=rf"^{data}: entry archive/data/0 \(15360 bytes\) does not match its "
                             rf"CRC-32 .*\(tensor 'fp32', the chunk at \(0, 0\), bytes "):
        _read(path, [_item("fp32", (10, 8), (4, 16))],  # a block: torch's reader
              {"fp32": torch.full((4, 16), SENTINEL, dtype=torch.float32)}, runs=True)
    target = torch.full((30, 40), SENTINEL, dtype=torch.float32)
    _read(path, [_item("fp32", (17, 0), (30, 40))], {"fp32": target}, runs=True)
    assert torch.equal(target, state["fp32"][17:47])
    # Unchecked (the benchmarks' switch), the whole tensor loads with the flipped bit.
    target = torch.full((96, 40), SENTINEL, dtype=torch.float32)
    with dcp_reader.crc_unchecked():
        _read(path, [_item("fp32", (0, 0), (96, 40))], {"fp32": target}, runs=True)
    assert not torch.equal(target, state["fp32"])
    assert torch.equal(target[:86], state["fp32"][:86])


def test_records_for_torchs_reader_are_checked_first(tmp_path):
    """A tensor stored strided and an object: torch's reader reads their records whole and
    checks no CRC; ours checks them before it does."""
    for fqn, item, targets in (
            ("transposed", _item("transposed", (0, 0), (96, 40)),
             {"transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}),
            ("bytes", _item("bytes", (), (), LoadItemType.BYTE_IO), {})):
        path, data, _, _ = _flipped(tmp_path / fqn, fqn)
        with pytest.raises(dcp_reader.DataFileError,
                           match=rf"^{data}: entry archive/[\w/.]+ \(\d+ bytes\) does not "
                                 rf"match its CRC-32 .*\({'tensor' if targets else 'object'} "
                                 rf"'{fqn}'"):
            _read(path, [item], targets, runs=True)
        if targets:  # torch's reader alone loads the flipped bit
            with dcp_reader.crc_unchecked():
                _read(path, [item], targets, runs=True)
            assert (targets[fqn] != _stored()[fqn]).sum() == 1


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
    dcp.save(_stored(), checkpoint_id=str(src), no_dist=True)
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
            _read(path, [_item("fp32", (0, 0), (96, 40))],
                  {"fp32": torch.full((96, 40), SENTINEL, dtype=torch.float32)}, runs=True)
