"""Cluster-life corner cases found in review: a lease taken over by two takers at once, the
job id of torchrun jobs, submitit's handler after SIGTERM and USR2, ranks that resolved
``checkpoint.load=auto`` differently, and a finalize that fails on rank 0."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest
from compose import make_cfg
from multiproc import run_distributed

from ckpt import io as checkpoint
from ckpt.io import lease
from recipes.run import preemption
from recipes.run.rank_env import job_id


def test_a_lease_another_taker_just_took_is_put_back(tmp_path, monkeypatch):
    """B judged the old holder stale; before B's rename, A replaced it with its own live lease.
    B must not delete A's lease: it puts it back and is refused."""
    path = tmp_path / lease.WRITER_LEASE
    stale = {"run_id": "old", "host": socket.gethostname(), "pid": 999999999}
    fresh = {"run_id": "a", "host": socket.gethostname(), "pid": os.getppid(),  # live
             "start": lease.process_start(os.getppid())}
    path.write_text(json.dumps(fresh))  # what is on disk when B renames
    real_read, calls = lease.read, []

    def read(p):
        calls.append(p)
        return dict(stale, heartbeat=time.time()) if len(calls) == 1 else real_read(p)

    monkeypatch.setattr(lease, "read", read)
    with pytest.raises(lease.LeaseHeld, match="in use by run a"):
        lease.Lease(path, run_id="b", job_id=None).take("checkpoint.save")
    assert json.loads(path.read_text())["run_id"] == "a", "A's lease was removed"
    assert not list(tmp_path.glob("*.stale.*"))


def test_torchrun_jobs_have_no_requeue_identity(monkeypatch):
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static rendezvous
    assert job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert job_id() == "77"


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_submitits_requeue_handler_runs_when_sigterm_came_first(handlers, monkeypatch):
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")
    called = []
    signal.signal(signal.SIGTERM, lambda s, f: called.append("term"))  # submitit's: only logs
    signal.signal(signal.SIGUSR2, lambda s, f: called.append("requeue"))
    train = make_cfg().train
    preemption.install(train)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.exit_reason(1, train) == "SIGTERM"
    preemption.after_exit()
    assert called == ["requeue"]


def _agree(load_by_rank, root):
    import torch
    from omegaconf import OmegaConf

    from recipes.checkpoint.policy import agree_load_iteration

    # Loadability is not what this tests (the dir holds a stand-in save).
    checkpoint.check_loadable = lambda root, it: checkpoint.iter_dir(root, it)
    rank = torch.distributed.get_rank()
    load = load_by_rank[rank]  # checkpoint.load=auto as each rank resolved it
    ck = OmegaConf.create({"load": load, "load_iteration": 6 if load else None, "save": root})
    return agree_load_iteration(ck), ck.load


def test_ranks_that_resolved_auto_differently_load_rank_0s_checkpoint(tmp_path):
    from test_preemption import fake_save

    fake_save(tmp_path, 6)
    (tmp_path / checkpoint.TRACKER).write_text("6\n")
    got = run_distributed(_agree, 2, [str(tmp_path), None], str(tmp_path), timeout=120)
    assert got == [(6, str(tmp_path)), (6, str(tmp_path))]
    got = run_distributed(_agree, 2, [None, str(tmp_path)], str(tmp_path), timeout=120)
    assert got == [(None, None), (None, None)]


def _finalize_with_rank0_refused(root):
    import torch

    from ckpt.io import CheckpointError

    rank = torch.distributed.get_rank()
    os.environ[lease.RUN_ID_ENV] = "me" if rank == 0 else "other"
    staged = checkpoint.staging_dir(root, 4)
    if rank == 0:
        staged.mkdir()
    try:
        checkpoint.finalize_save(root, 4, staged)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_finalize_refused_on_rank_0_fails_on_every_rank(tmp_path):
    (tmp_path / lease.WRITER_LEASE).write_text(json.dumps(
        {"run_id": "other", "host": "node7", "pid": 5}))
    got = run_distributed(_finalize_with_rank0_refused, 2, str(tmp_path), timeout=120)
    assert got[0] and got[0].startswith("LeaseHeld") and "not by this run (me)" in got[0], got
    # issue 59.6: the same message on every rank, in the one form of a failed save.
    assert got[1] == "CheckpointError" + got[0][len("LeaseHeld"):], got
    assert re.search(r": the save of iteration 4 into .* failed on rank\(s\) \[0\]: rank 0: "
                     r"checking the writer lease failed: LeaseHeld: .*Nothing was renamed into "
                     r"place; .* has no latest_checkpointed_iteration.txt yet", got[1]), got
    assert not checkpoint.iter_dir(tmp_path, 4).exists()


def test_a_lease_naming_this_process_an_ancestor_or_a_reused_pid_goes_stale(tmp_path):
    """issue 33.5: a container restarted as pid 1 again, or a pid reused by another process,
    names a process that is alive; neither may hold the dir for ever."""
    import multiprocessing as mp

    here, path = socket.gethostname(), tmp_path / lease.WRITER_LEASE
    other = mp.get_context("fork").Process(target=time.sleep, args=(60,))  # live, unrelated
    other.start()
    try:
        start = lease.process_start(other.pid)
        assert start is not None and lease.Lease(path).me["start"] == lease.process_start(os.getpid())
        cases = [  # (holder, age of its heartbeat, taken over because)
            ({"pid": os.getpid()}, 0, "this process"),  # one it no longer holds
            ({"pid": os.getppid()}, 0, "an ancestor of this process"),  # no start recorded
            ({"pid": other.pid, "start": start + 1}, 0, "now another process"),
            # Its live process with its start time holds it, whatever the heartbeat's age.
            ({"pid": other.pid, "start": start}, lease.STALE_AFTER_S + 5, None),
            ({"pid": other.pid, "start": start}, 0, None),
            ({"pid": other.pid}, 0, None),  # an older lease without a start time, not watched
        ]
        for holder, age, why in cases:
            _write(path, age, run_id="x", host=here, **holder)
            got = lease.stale_reason(lease.read(path), None)
            assert (got is None) if why is None else (why in (got or "")), (holder, age, got)
    finally:
        other.kill()
        other.join()


def _write(path, age_s: float, **holder) -> None:
    path.write_text(json.dumps(holder))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_live_pid_1_or_parent_with_its_start_time_holds_its_lease(tmp_path):
    """issue 33 review: train.py as a container's main process (pid 1) holds its lease against
    a second train.py started by ``docker exec``; so does a live parent that recorded its start
    time. A restarted container's new pid 1 has another start time: stale."""
    here, path = socket.gethostname(), tmp_path / lease.WRITER_LEASE
    for pid in (1, os.getppid()):
        start = lease.process_start(pid)
        assert start is not None
        _write(path, 0, run_id="x", host=here, pid=pid, start=start)
        assert lease.stale_reason(lease.read(path), None) is None, pid
        with pytest.raises(lease.LeaseHeld, match="in use by run x"):
            lease.Lease(path, run_id="y", job_id=None).take("checkpoint.save")
        _write(path, 0, run_id="x", host=here, pid=pid, start=start + 1)
        assert "now another process" in lease.stale_reason(lease.read(path), None)


def test_two_runs_of_one_allocation_do_not_take_each_others_lease(tmp_path, monkeypatch):
    """issue 33 review: a live holder of this job's id is another run of the same allocation,
    not this job before a requeue: refused on this host; one on another host is waited for
    until its heartbeat stops (a requeue), refused while it beats. A requeue on this host,
    whose old process is gone, takes over at once."""
    import multiprocessing as mp
    import threading

    here, path = socket.gethostname(), tmp_path / lease.WRITER_LEASE
    other = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    other.start()
    try:
        _write(path, 0, run_id="x", job_id="77", host=here, pid=other.pid,
               start=lease.process_start(other.pid))
        with pytest.raises(lease.LeaseHeld, match="in use by run x"):
            lease.Lease(path, run_id="y", job_id="77").take("checkpoint.save")
    finally:
        other.kill()
        other.join()
    note = lease.Lease(path, run_id="y", job_id="77").take("checkpoint.save")
    assert "its process is gone (this job, 77, before a requeue)" in note, note
    lease.Lease(path, run_id="y").release()
    monkeypatch.setattr(lease, "STALE_AFTER_S", 1.0)
    _write(path, 0, run_id="x", job_id="77", host="node9", pid=5)  # its beat stops now
    began = time.time()
    note = lease.Lease(path, run_id="z", job_id="77").take("checkpoint.save")
    assert time.time() - began >= 1.0 and "did not move" in note and "before a requeue" in note
    lease.Lease(path, run_id="z").release()
    _write(path, 0, run_id="x", job_id="77", host="node9", pid=5)
    stop = threading.Event()
    beat = threading.Thread(target=lambda: [os.utime(path) for _ in iter(
        lambda: stop.wait(0.2), True)], daemon=True)
    beat.start()
    try:
        with pytest.raises(lease.LeaseHeld, match="job 77.*node9"):
            lease.Lease(path, run_id="w", job_id="77").take("checkpoint.save")
    finally:
        stop.set()
        beat.join()


def _beating(path, stop, every_s: float, offset_s: float) -> None:
    """Another host's live holder: its heartbeat moves every ``every_s``, stamped by a clock
    ``offset_s`` away from this one (its own, or its file server's)."""
    while not stop.wait(every_s):
        t = time.time() + offset_s
        os.utime(path, (t, t))


def test_heartbeats_are_judged_by_change_not_against_this_hosts_clock(tmp_path, monkeypatch):
    """Issue 59.2: a lease of another host stamped 1 h ahead whose heartbeat no longer moves is
    taken over after the watch (not after an hour); one stamped 90 s behind that keeps beating
    is live; so is a live holder on this host whose file's time lags 90 s."""
    import multiprocessing as mp
    import threading

    monkeypatch.setattr(lease, "STALE_AFTER_S", 0.6)
    here, path = socket.gethostname(), tmp_path / lease.WRITER_LEASE
    _write(path, -3600, run_id="x", host="node7", pid=5)  # an hour ahead, not beating
    began = time.monotonic()
    note = lease.Lease(path, run_id="me", job_id=None).take("checkpoint.save")
    assert "its heartbeat did not move in 1 s watched" in note, note
    assert time.monotonic() - began < 5
    lease.Lease(path, run_id="me").release()
    _write(path, 90, run_id="x", host="node7", pid=5)
    stop = threading.Event()
    beat = threading.Thread(target=_beating, args=(path, stop, 0.1, -90), daemon=True)
    beat.start()
    try:
        with pytest.raises(lease.LeaseHeld, match="in use by run x.*last heartbeat at .* "
                                                  r"\(file time\)"):
            lease.Lease(path, run_id="me", job_id=None).take("checkpoint.save")
    finally:
        stop.set()
        beat.join()
    other = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    other.start()
    try:
        _write(path, 90, run_id="x", host=here, pid=other.pid,
               start=lease.process_start(other.pid))
        with pytest.raises(lease.LeaseHeld, match="in use by run x"):
            lease.Lease(path, run_id="me", job_id=None).take("checkpoint.save")
    finally:
        other.kill()
        other.join()


def test_a_heartbeat_that_fails_for_a_while_retries_and_says_so_once(tmp_path, monkeypatch,
                                                                      capsys):
    """Issue 59.2: a read-only window (EROFS) fails some beats; the heartbeat says so once,
    beats again when it ends, and says that once."""
    import errno

    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
    path = tmp_path / lease.WRITER_LEASE
    held = lease.Lease(path, run_id="me", job_id=None)
    real, calls = os.utime, []

    def utime(p, *args, **kwargs):
        calls.append(p)
        if len(calls) <= 5:
            raise OSError(errno.EROFS, "Read-only file system", str(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(lease.os, "utime", utime)
    held.take("checkpoint.save")
    real(path, (1000, 1000))
    deadline = time.monotonic() + 10
    while path.stat().st_mtime == 1000 and time.monotonic() < deadline:
        time.sleep(0.05)
    held.release()
    assert path.exists() is False
    err = capsys.readouterr().err
    assert err.count("the heartbeat of") == 2, err
    assert f"> warning: the heartbeat of {path} failed ([Errno 30] Read-only file system" in err
    assert "is renewed again after" in err and len(calls) > 5


def test_release_never_raises_on_a_dead_file_system(tmp_path, monkeypatch):
    """Issue 59.6: a save dir remounted read-only (or gone): release (also its atexit
    callback) leaves the file and returns."""
    import errno

    held = lease.Lease(tmp_path / lease.WRITER_LEASE, run_id="me", job_id=None)
    held.take("checkpoint.save")
    for err in (errno.EROFS, errno.EIO, errno.ESTALE):
        def fail(*args, err=err, **kwargs):
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(type(held.path), "unlink", fail)
        held.release()
        monkeypatch.setattr(type(held.path), "read_text", fail)
        held.release()
        monkeypatch.undo()
    assert held.path.exists()
