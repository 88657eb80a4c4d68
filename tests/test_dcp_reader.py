"""ckpt.format.dcp_reader: a DCP read request that covers a run of a stored tensor's rows reads those
bytes only, and every request reads the same values as torch's own reader."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from ckpt.format import dcp_reader, dcp_records
from dcp_reads import (
    SENTINEL, file_reader, read, read_item, stored,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp")
    state = stored()
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, state



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
        got = read(path, [read_item(fqn, offsets, lengths)], {fqn: target}, runs)
        assert got[fqn].data_ptr() == target.data_ptr() or not target.numel()
        assert torch.equal(target, want), (fqn, runs)


def _records(path):
    reader = file_reader(path)
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
    read(path, [read_item("int64", (7,), (1,))], {"int64": target}, runs=True)
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
        read(path, [read_item("fp32", (17, 0), (rows, 40))], {"fp32": target}, runs, counter)
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
    items = [read_item("fp32", (17, 0), (30, 40)), read_item("fp32_3d", (2, 3, 0), (1, 5, 8)),
             read_item("int64", (7,), (20,))]
    read(path, items, {"fp32": target, "fp32_3d": target_3d, "int64": live_int[:, 1]},
          runs=True)
    assert torch.equal(target, state["fp32"][17:47].double())
    assert (live[:, 1::2] == SENTINEL).all()
    assert torch.equal(target_3d, state["fp32_3d"][2:3, 3:8])
    assert (live_3d[:, :4] == SENTINEL).all() and (live_3d[:, 12:] == SENTINEL).all()
    assert torch.equal(live_int[:, 1], state["int64"][7:27])
    assert (live_int[:, 0] == SENTINEL).all()


def test_object_items_and_mixed_plans_go_through_torch(checkpoint):
    path, state = checkpoint
    items = [read_item("bytes", (), (), LoadItemType.BYTE_IO), read_item("int64", (7,), (20,)),
             read_item("transposed", (0, 0), (96, 40))]
    targets = {"int64": torch.full((20,), SENTINEL, dtype=torch.int64),
               "transposed": torch.full((96, 40), SENTINEL, dtype=torch.float32)}
    got = read(path, items, targets, runs=True)
    assert got["bytes"] == b"not a tensor"
    assert torch.equal(targets["int64"], state["int64"][7:27])
    assert torch.equal(targets["transposed"], state["transposed"])


def test_wrong_target_shape_is_refused(checkpoint):
    path, _ = checkpoint
    with pytest.raises(AssertionError, match="mismatch sizes"):
        read(path, [read_item("fp32", (0, 0), (10, 40))],
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
