"""gtp.safe_metadata: ``.metadata`` is read without running code from it, and within
``reused()`` each unchanged file is unpickled once, each reader getting its own copy."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from gtp import safe_metadata


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
