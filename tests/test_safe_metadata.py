"""ckpt.format.safe_metadata: ``.metadata`` is read without running code from it, and within
``reused()`` each unchanged file is unpickled once, each reader getting its own copy."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import threading
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ckpt.format import safe_metadata


def _save(path, rows: int):
    dcp.save({"w": torch.arange(rows * 4, dtype=torch.float32).view(rows, 4),
              "b": torch.zeros(3)}, checkpoint_id=str(path), no_dist=True)


@pytest.fixture
def unpicklings(monkeypatch):
    """Counts the restricted unpickler's loads."""
    count = [0]
    load = safe_metadata._RestrictedUnpickler.load

    def counted(self):
        count[0] += 1
        return load(self)

    monkeypatch.setattr(safe_metadata._RestrictedUnpickler, "load", counted)
    return count


def _rows(metadata) -> int:
    return metadata.state_dict_metadata["w"].size[0]


def test_reused_unpickles_each_file_once_and_hands_out_copies(tmp_path, unpicklings):
    _save(tmp_path, rows=6)
    safe_metadata.install()
    with safe_metadata.reused():
        first = safe_metadata.read_metadata(tmp_path)
        through_dcp = FileSystemReader(str(tmp_path)).read_metadata()
        again = safe_metadata.read_metadata(tmp_path)
        assert unpicklings[0] == 1
        assert _rows(first) == _rows(through_dcp) == _rows(again) == 6
        assert first.storage_data == again.storage_data
        # Each reader owns its top-level containers and storage_meta.
        first.storage_data.clear()
        first.state_dict_metadata.pop("w")
        first.storage_meta.load_id = "mine"
        assert again.storage_data and "w" in again.state_dict_metadata
        assert again.storage_meta.load_id != "mine"
        assert _rows(safe_metadata.read_metadata(tmp_path)) == 6
        assert unpicklings[0] == 1
    # Outside the block every read unpickles.
    safe_metadata.read_metadata(tmp_path)
    safe_metadata.read_metadata(tmp_path)
    assert unpicklings[0] == 3


def test_reused_rereads_a_rewritten_file(tmp_path, unpicklings):
    _save(tmp_path, rows=6)
    with safe_metadata.reused():
        assert _rows(safe_metadata.read_metadata(tmp_path)) == 6
        os.replace(tmp_path / ".metadata", tmp_path / "old.metadata")
        _save(tmp_path, rows=10)  # another file under the same name
        assert _rows(safe_metadata.read_metadata(tmp_path)) == 10
        assert unpicklings[0] == 2


def test_nested_blocks_share_the_outer_cache(tmp_path, unpicklings):
    _save(tmp_path, rows=6)
    with safe_metadata.reused():
        safe_metadata.read_metadata(tmp_path)
        with safe_metadata.reused():
            safe_metadata.read_metadata(tmp_path)
        safe_metadata.read_metadata(tmp_path)  # the inner exit kept the outer cache
    assert unpicklings[0] == 1


def test_each_thread_has_its_own_cache(tmp_path, unpicklings):
    _save(tmp_path, rows=6)
    inside, leave = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        seen["outside"] = _rows(safe_metadata.read_metadata(tmp_path))  # no block here: reads
        with safe_metadata.reused():
            seen["inside"] = _rows(safe_metadata.read_metadata(tmp_path))  # its own cache
            inside.set()
            leave.wait(30)

    with safe_metadata.reused():
        safe_metadata.read_metadata(tmp_path)
        assert unpicklings[0] == 1
        worker = threading.Thread(target=other_thread)
        worker.start()
        assert inside.wait(30)
        assert unpicklings[0] == 3  # the other thread read twice, into no cache of this one's
        leave.set()
        worker.join(30)
        assert not worker.is_alive() and seen == {"outside": 6, "inside": 6}
        # The other thread's block ended; this thread's cache is still there.
        safe_metadata.read_metadata(tmp_path)
        assert unpicklings[0] == 3


class _Runs:
    def __reduce__(self):
        return (os.getcwd, ())


def test_a_file_naming_another_global_is_refused_every_time(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Runs()))
    with safe_metadata.reused():
        for _ in range(2):
            with pytest.raises(safe_metadata.UnsafeMetadataError, match="posix.getcwd"):
                safe_metadata.read_metadata(tmp_path)


# Crafted files (issue 33.1): each would touch a marker file if anything in it ran.

def _short(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _dotted_payload(marker) -> bytes:
    """Protocol 4: STACK_GLOBAL(<an allowed module>, "os.system") called with ``touch``."""
    return (pickle.PROTO + b"\x04" + _short("torch.distributed.checkpoint.filesystem")
            + _short("os.system") + pickle.STACK_GLOBAL + _short(f"touch {marker}")
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def test_a_dotted_name_reaching_another_module_is_refused(tmp_path):
    _save(tmp_path, rows=2)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(_dotted_payload(marker))
    safe_metadata.install()
    with pytest.raises(safe_metadata.UnsafeMetadataError, match=r"filesystem\.os\.system"):
        safe_metadata.read_metadata(tmp_path)
    with pytest.raises(safe_metadata.UnsafeMetadataError):
        FileSystemReader(str(tmp_path)).read_metadata()
    from ckpt import verify

    metadata, problems = verify.read_metadata(tmp_path)
    assert metadata is None and any("os.system" in p.what for p in problems)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["inspect", "export", "convert"])
def test_commands_refuse_a_crafted_metadata_once_without_traceback(tmp_path, capsys, command):
    from ckpt import cli

    _save(tmp_path / "ckpt", rows=2)
    marker = tmp_path / "ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(_dotted_payload(marker))
    args = [command, str(tmp_path / "ckpt")] + ([] if command == "inspect" else [str(tmp_path / "out")])
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    assert "error: UnsafeMetadataError:" in err and "os.system" in err, err
    assert not marker.exists()


def test_state_set_on_an_allowed_class_is_refused(tmp_path):
    """BUILD whose target is a class (slot state would setattr on it)."""
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / ".metadata").write_bytes(
        pickle.PROTO + b"\x04" + _short("torch.distributed.checkpoint.metadata")
        + _short("Metadata") + pickle.STACK_GLOBAL + pickle.NONE + pickle.EMPTY_DICT
        + _short("crafted") + pickle.BININT1 + b"\x01" + pickle.SETITEM + pickle.TUPLE2
        + pickle.BUILD + pickle.STOP)
    with pytest.raises(safe_metadata.UnsafeMetadataError, match="BUILD"):
        safe_metadata.read_metadata(tmp_path)
    assert not hasattr(Metadata, "crafted")
    # An instance's own __setstate__ (a later BUILD on it would call it): refused too.
    (tmp_path / ".metadata").write_bytes(
        pickle.PROTO + b"\x04" + _short("torch.distributed.checkpoint.metadata")
        + _short("StorageMeta") + pickle.STACK_GLOBAL + pickle.EMPTY_TUPLE + pickle.NEWOBJ
        + pickle.EMPTY_DICT + _short("__setstate__") + _short("pathlib") + _short("PosixPath")
        + pickle.STACK_GLOBAL + pickle.SETITEM + pickle.BUILD + pickle.STOP)
    with pytest.raises(safe_metadata.UnsafeMetadataError, match="special attribute"):
        safe_metadata.read_metadata(tmp_path)


class _Inner:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _FromBytes:
    """Reduced to torch's own storage reader (torch.load with weights_only=False)."""

    def __init__(self, blob):
        self.blob = blob

    def __reduce__(self):
        import torch.storage

        return (torch.storage._load_from_bytes, (self.blob,))


def test_a_storage_reader_that_unpickles_anything_is_refused(tmp_path):
    _save(tmp_path, rows=2)
    marker = tmp_path / "ran"
    inner = io.BytesIO()
    torch.save(_Inner(marker), inner)
    metadata = safe_metadata.read_metadata(tmp_path)
    metadata.planner_data = _FromBytes(inner.getvalue())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    with pytest.raises(safe_metadata.UnsafeMetadataError, match="_load_from_bytes"):
        safe_metadata.read_metadata(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp", ".."])
def test_a_data_file_outside_the_dir_is_refused(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, rows=2)
    metadata = safe_metadata.read_metadata(ckpt)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index],
                                                       relative_path=name)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    with pytest.raises(safe_metadata.UnsafeMetadataError, match=re.escape(repr(index.fqn))):
        safe_metadata.read_metadata(ckpt)


def test_a_data_file_symlinked_outside_the_dir_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt, rows=2)
    data = next(ckpt.glob("*.distcp"))
    os.replace(data, tmp_path / data.name)
    data.symlink_to(tmp_path / data.name)
    with pytest.raises(safe_metadata.UnsafeMetadataError, match="outside the checkpoint dir"):
        safe_metadata.read_metadata(ckpt)
    os.unlink(data)
    os.symlink(data.name + ".real", data)  # a symlink inside the dir is read
    os.replace(tmp_path / data.name, ckpt / (data.name + ".real"))
    assert _rows(safe_metadata.read_metadata(ckpt)) == 2


def _bomb(inflated: int) -> bytes:
    """A torch.save record of ``inflated`` zero bytes, its entries deflated."""
    plain, out = io.BytesIO(), io.BytesIO()
    torch.save({"bomb": torch.zeros(inflated, dtype=torch.uint8)}, plain)
    source = zipfile.ZipFile(plain)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for info in source.infolist():
            zf.writestr(info.filename, source.read(info.filename))
    return out.getvalue()


def test_a_compressed_record_is_refused_uninflated(tmp_path, monkeypatch):
    from ckpt.format import safe_objects, zip_records
    from ckpt import verify

    record = _bomb(50 << 20)
    assert len(record) < 1 << 20
    dcp.save({"obj": 7, "w": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = safe_metadata.read_metadata(tmp_path)
    index = next(i for i in metadata.storage_data if i.fqn == "obj")
    info = metadata.storage_data[index]
    data = tmp_path / info.relative_path
    end = data.stat().st_size
    with open(data, "ab") as f:
        f.write(record)
    metadata.storage_data[index] = dataclasses.replace(info, offset=end, length=len(record))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load reached: it would inflate the record")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(safe_objects.UnsafeObjectError, match="archive/data.pkl is compressed"):
        safe_objects.load_object(io.BytesIO(record), "obj")
    with pytest.raises(zip_records.RecordDamaged, match="compressed"):
        zip_records.check_record(io.BytesIO(record), 0, len(record))
    problems = verify.check_data_files(tmp_path, safe_metadata.read_metadata(tmp_path))
    assert any("compressed" in p.what and "obj" in p.item for p in problems), problems
    safe_objects.install()
    with pytest.raises(BaseException) as caught:  # torch DCP's CheckpointException
        dcp.load({"obj": 0}, checkpoint_id=str(tmp_path), no_dist=True)
    # refused by load_object, or, where ckpt.format.dcp_reader is installed, by its record check
    errors = [f[0] if isinstance(f, tuple) else f
              for f in getattr(caught.value, "failures", {}).values()] or [caught.value]
    assert any("archive/data.pkl is compressed" in str(e) for e in errors), errors


def test_verify_reads_no_fifo_as_metadata_json(tmp_path):
    from ckpt import verify

    _save(tmp_path, rows=2)
    os.mkfifo(tmp_path / "metadata.json")
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=verify.read_metadata(tmp_path)),
                              daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # unblock the reader, then fail
        os.close(os.open(tmp_path / "metadata.json", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("verify.read_metadata blocked on a FIFO")
    _, problems = result["out"]
    assert [p.what for p in problems if p.file.endswith("metadata.json")] == [
        "unreadable: not a regular file"]


@pytest.mark.parametrize("index, match", [
    ([1], "no weight_map object"),
    ({"weight_map": {"wte.weight": 5}}, r"weight_map\['wte.weight'\] = 5: a file name"),
])
def test_a_malformed_hf_index_is_named(tmp_path, index, match):
    import json

    from ckpt.hf.hf_weights import HFImportError, Weights

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFImportError, match=match):
        Weights(tmp_path)
