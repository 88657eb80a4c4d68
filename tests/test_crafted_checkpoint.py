"""A checkpoint handed over by someone else runs no code, and a stray ``common.pt`` is damage.

A checkpoint the workers wrote (tiny model, dp2, 2 iterations) is copied and crafted: one of its
object records (the common state, one rank's RNG state) is replaced by a ``torch.save``d list
whose element's ``__reduce__`` would create a marker file, the data file's records and
``.metadata``'s offsets rewritten to match, so that every CRC-32 holds and ``gtp verify``'s
offset checks pass (``.metadata`` itself still names only allowed classes). ``gtp verify``,
``gtp inspect``, ``gtp export``, the common-state read of every load (``checkpoint.load``, ``auto``,
``checkpoint.pretrained``) and a resume's ``dist_checkpointing.load`` each refuse it, naming the
object, and the marker never appears. A ``common.pt`` beside the data files (megatron-core would
read it in place of the common state the save wrote) is reported by ``gtp verify`` and refused by
every load, naming the file.

Each refusal in a worker (crafted, damaged, a failed ``checkpoint.pretrained`` load) is one
``error:`` message, printed once, with no traceback and exit code 2 (:func:`assert_one_refusal`).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ITER = 2
COMMON = "common_state/shard_0_1"
RNG = "rng_state/shard_0_2"  # rank 0's of a dp2 save


@pytest.fixture(scope="module")
def saved(train_jobs, tmp_path_factory):
    """The checkpoint every test copies: trained in one world as torchrun's workers train it
    (tests/helpers/inworld.py); the refusals below go through train.py."""
    run = tmp_path_factory.mktemp("crafted") / "run"
    train_jobs([(run, [f"train.train_iters={ITER}", f"checkpoint.save_interval={ITER}"])])
    return run / "checkpoints"


class _Payload:
    """Unpickled by an unrestricted unpickler, it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root, root / f"iter_{ITER:07d}"


def replace_record(iter_path: Path, fqn: str, record: bytes) -> None:
    """Put ``record`` in place of the stored record of object ``fqn``: its data file rebuilt
    record by record, and ``.metadata``'s offsets and lengths rewritten to match (a crafted
    checkpoint with consistent offsets: every CRC-32 and offset check holds)."""
    from ckpt.format.safe_metadata import read_metadata

    metadata = read_metadata(iter_path)
    target = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    name = target.relative_path
    infos = sorted((info for info in metadata.storage_data.values()
                    if info.relative_path == name), key=lambda i: i.offset)
    old = (iter_path / name).read_bytes()
    out = bytearray()
    for info in infos:
        data = record if info is target else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(data)
        out += data
    (iter_path / name).write_bytes(bytes(out))
    (iter_path / ".metadata").write_bytes(pickle.dumps(metadata))


def craft(iter_path: Path, fqn: str, marker: Path) -> None:
    blob = io.BytesIO()
    torch.save([_Payload(marker)], blob)
    replace_record(iter_path, fqn, blob.getvalue())


def assert_one_refusal(proc, *parts: str) -> None:
    """``train.py`` stopped on a refusal: exit code 2, no traceback, one ``error:`` line holding
    every part, its message printed nowhere else, and no iteration trained."""
    out = proc.stdout
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and out.count("error: ") == 1, out[-6000:]
    assert "exitcode" not in out, out[-6000:]  # nor the elastic agent's log of each failure
    line = out[out.index("error: "):].splitlines()[0]
    assert out.count(line[len("error: "):]) == 1, out[-6000:]  # printed once, by no rank
    for part in parts:
        assert part in line, (part, out[-6000:])
    assert not re.search(r"iteration +\d+/\d+ \|", out), out[-3000:]


def _cli(*argv) -> tuple[int, str]:
    from contextlib import redirect_stderr

    from ckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        rc = main([*map(str, argv)], out=out)
    return rc, out.getvalue() + err.getvalue()


def test_the_crafted_copy_passes_every_check_but_the_unpickling(saved, tmp_path):
    """The crafting itself: byte-consistent (so nothing but the unpickling can refuse it: the
    data files' check names only the crafted object, which it reads as the load does)."""
    from ckpt import verify

    root, path = _copy(saved, tmp_path)
    craft(path, COMMON, tmp_path / "marker")
    metadata, problems = verify.read_metadata(path)
    assert problems == [] and verify.check_metadata(path, metadata) == []
    problems = verify.check_data_files(path, metadata)
    assert [(p.item, "posix.system" in p.what) for p in problems] == [
        (f"object {COMMON!r}", True)], problems


def test_commands_refuse_a_crafted_common_state_and_run_nothing(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    craft(path, COMMON, marker)
    rc, out = _cli("verify", root)
    assert rc == 1 and not marker.exists(), out
    assert re.search(rf"DAMAGED {re.escape(str(path))}: object 'common_state': .*{COMMON}.*"
                     rf"posix\.system", out), out
    for command in (["inspect", root], ["export", root, tmp_path / "hf"]):
        rc, out = _cli(*command)
        assert rc == 2 and not marker.exists(), (command, out)
        assert COMMON in out and "posix.system" in out, (command, out)
    # The common-state read of every load (checkpoint.load=DIR / auto, checkpoint.pretrained).
    from recipes.run import pretrained
    from ckpt.io import CheckpointError, load_common
    from recipes.config.validate import ConfigError

    with pytest.raises(CheckpointError, match=rf"{COMMON}.*posix\.system"):
        load_common(root)
    with pytest.raises(ConfigError, match=rf"{COMMON}.*posix\.system"):
        pretrained.source_config(root)
    assert not marker.exists()


@pytest.mark.parametrize("item", [COMMON, RNG], ids=["common_state", "rng_state"])
def test_a_resume_refuses_a_crafted_object(saved, tmp_path, train_run, item):
    """The common state, or (the common state intact) one of the objects megatron's
    ``dist_checkpointing.load`` reads (same layout: the RNG states are loaded)."""
    root, path = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    craft(path, item, marker)
    proc = train_run(tmp_path / "resumed", "train.train_iters=4", f"checkpoint.load={root}",
                     rc=None)
    assert not marker.exists(), proc.stdout[-3000:]
    assert_one_refusal(proc, item, "posix.system")


def _stray_common_pt(path: Path) -> Path:
    """A ``common.pt`` holding the save's common state with no sample consumed and no
    scheduler step taken (a resume would restart warm-up and the data order under trained
    weights): what megatron-core reads in place of the common state in the data files."""
    from megatron.core import dist_checkpointing

    common = dict(dist_checkpointing.load_common_state_dict(str(path)))
    common["train_state"] = {**common["train_state"], "consumed_samples": 0}
    common["opt_param_scheduler"] = {**common["opt_param_scheduler"], "num_steps": 0}
    torch.save(common, path / "common.pt")
    return path / "common.pt"


def test_a_stray_common_pt_is_damage_to_verify_and_every_load(saved, tmp_path, train_run):
    root, path = _copy(saved, tmp_path)
    stray = _stray_common_pt(path)
    rc, out = _cli("verify", root)
    assert rc == 1, out
    assert f"DAMAGED {stray}: " in out, out
    for command in (["inspect", root], ["export", root, tmp_path / "hf"]):
        rc, out = _cli(*command)
        assert rc == 2 and str(stray) in out, (command, out)
    from ckpt.io import CheckpointError, load_common

    with pytest.raises(CheckpointError, match=re.escape(str(stray))):
        load_common(root)
    # Unverified too: the load itself refuses it.
    proc = train_run(tmp_path / "resumed", "train.train_iters=4", f"checkpoint.load={root}",
                     "checkpoint.verify_on_load=false", rc=None)
    assert proc.returncode != 0 and str(stray) in proc.stdout, proc.stdout[-3000:]
    assert not re.search(r"iteration +\d+/\d+ \|", proc.stdout), proc.stdout[-3000:]


def _flip_byte(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


# One flipped byte the workers' verification finds (checkpoint.verify_on_load): in rank 1's RNG
# state for a resume, in a model tensor for checkpoint.pretrained (which loads weights only).
@pytest.mark.parametrize("how, file, where, fix", [
    ("load", "__1_0.distcp", 0.5, "checkpoint.load_iteration=N"),
    ("pretrained", "__0_0.distcp", 1 / 3, "another checkpoint.pretrained"),
])
def test_a_damaged_checkpoint_is_one_message_without_traceback(how, file, where, fix, saved,
                                                               tmp_path, train_run):
    root, path = _copy(saved, tmp_path)
    _flip_byte(path / file, where)
    proc = train_run(tmp_path / "run", "train.train_iters=4", f"checkpoint.{how}={root}", rc=None)
    assert_one_refusal(proc, f"{path} is damaged", "CRC-32", fix)
    assert "failed on another rank" not in proc.stdout, proc.stdout[-3000:]


class _Mesh:
    """Unpickled, it builds ``DeviceMesh("cpu", [0])``, a class torch's weights-only list holds
    once ``torch.distributed.tensor`` is imported (megatron-core imports it), whose constructor
    joins a process group: with torchrun's variables set, ``init_process_group`` waits for the
    world's other ranks forever."""

    def __reduce__(self):
        from torch.distributed.device_mesh import DeviceMesh

        return (DeviceMesh, ("cpu", [0]))


def _mesh_record() -> bytes:
    blob = io.BytesIO()
    torch.save({"iteration": ITER, "mesh": _Mesh()}, blob)
    return blob.getvalue()


def test_a_device_mesh_in_the_common_state_is_one_line_and_joins_no_process_group(
        saved, tmp_path):
    """``gtp inspect`` with torchrun's variables set (as in a job script): refused in one line
    naming the record and the class, in seconds; ``gtp verify`` reports it as damage."""
    import subprocess
    import sys

    root, path = _copy(saved, tmp_path)
    replace_record(path, COMMON, _mesh_record())
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29581"}
    try:
        proc = subprocess.run([sys.executable, "-m", "gtp", "inspect", str(root)], env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"gtp inspect hung: {exc}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert out.count("\n") == 1 and COMMON in out, out
    assert "torch.distributed.device_mesh.DeviceMesh" in out, out
    rc, out = _cli("verify", root)
    assert rc == 1, out
    assert re.search(rf"DAMAGED {re.escape(str(path))}: object 'common_state': .*{COMMON}.*"
                     rf"torch\.distributed\.device_mesh\.DeviceMesh", out), out


def _extra_state_item(path: Path) -> str:
    from ckpt.format.safe_metadata import read_metadata

    items = sorted(index.fqn for index in read_metadata(path).storage_data
                   if index.offset is None and "_extra_state" in index.fqn)
    assert items, "the save holds no _extra_state record"
    return items[0]


@pytest.mark.parametrize("which", ["rng_state", "_extra_state", "mesh"])
def test_verify_checks_every_object_record_as_the_load_does(which, saved, tmp_path):
    """A code payload in an RNG state or an ``_extra_state`` record (the load refuses both),
    and a ``DeviceMesh`` in an RNG state: ``gtp verify`` says DAMAGED, naming the record and
    the global; nothing runs."""
    root, path = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    item = _extra_state_item(path) if which == "_extra_state" else RNG
    if which == "mesh":
        replace_record(path, item, _mesh_record())
    else:
        craft(path, item, marker)
    rc, out = _cli("verify", root)
    assert rc == 1 and not marker.exists(), out
    named = "torch.distributed.device_mesh.DeviceMesh" if which == "mesh" else "posix.system"
    assert re.search(rf"DAMAGED {re.escape(str(path))}/__\d+_\d+\.distcp: object "
                     rf"{re.escape(repr(item))}: .*{named}", out), out
