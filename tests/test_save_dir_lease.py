"""One live writer per save dir (ckpt/io/lease.py): a live lease refused naming its holder,
stale ones taken over with a note, one winner among jobs starting together, a save dir taken
over refused at finalize, and a second job on a live job's save dir refused before launch."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from compose import make_cfg
from test_preemption import fake_save

from ckpt import io as checkpoint
from ckpt.io import lease

REPO = Path(__file__).resolve().parents[1]


# --- one live writer per save dir -----------------------------------------------------------

def test_a_live_lease_is_refused_naming_the_holder_and_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_S", 0.1)  # the holder beats while it is watched
    first = lease.Lease(tmp_path / lease.WRITER_LEASE, run_id="aaa", job_id="11")
    assert first.take("checkpoint.save") is None
    # As another node's holder would see it (a holder that is this very process is stale).
    path = tmp_path / lease.WRITER_LEASE
    path.write_text(json.dumps({**json.loads(path.read_text()), "host": "node7"}))
    second = lease.Lease(tmp_path / lease.WRITER_LEASE, run_id="bbb", job_id="22")
    with pytest.raises(lease.LeaseHeld, match=rf"checkpoint.save {tmp_path} is in use by run aaa "
                                              rf"\(job 11\), process {os.getpid()} on node7.*remove "
                                              rf"{tmp_path / lease.WRITER_LEASE}"):
        second.take("checkpoint.save")
    first.release()
    assert not (tmp_path / lease.WRITER_LEASE).exists()
    assert second.take("checkpoint.save") is None
    second.release()


def _write_holder(path: Path, age_s: float, **holder) -> None:
    path.write_text(json.dumps(holder))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_stale_leases_are_taken_over_with_a_note(tmp_path, monkeypatch):
    import threading

    from test_cluster_races import _beating

    monkeypatch.setattr(lease, "STALE_AFTER_S", 1.0)  # how long another host's file is watched
    path = tmp_path / lease.WRITER_LEASE
    here = socket.gethostname()
    cases = [  # (holder, age of its heartbeat, taken over?)
        ({"run_id": "x", "host": here, "pid": 999999999}, 0, "its process is gone"),
        # A damaged or hand-edited file: a pid that names no process (was a traceback from
        # int() or os.kill: ValueError, TypeError, OverflowError).
        ({"run_id": "x", "host": here, "pid": "abc"}, 0, "its process is gone"),
        ({"run_id": "x", "host": here, "pid": [1]}, 0, "its process is gone"),
        ({"run_id": "x", "host": here, "pid": 10 ** 23, "start": "soon"}, 0,
         "its process is gone"),
        ({"run_id": ["x"], "host": here, "pid": True}, 0, "its process is gone"),
        ({"run_id": "x", "host": "node7", "pid": 1}, 0, "its heartbeat did not move"),
        # This job before a requeue: on this host its process is gone (at once); on another
        # host its heartbeat is watched like any other.
        ({"run_id": "x", "host": here, "pid": 999999999, "job_id": "42"}, 0,
         "its process is gone (this job, 42, before a requeue)"),
        ({"run_id": "x", "host": "node7", "pid": 1, "job_id": "42"}, 0,
         "its heartbeat did not move in 1 s watched (this job, 42, before a requeue)"),
        ({"run_id": "x", "host": "node7", "pid": 1, "job_id": "41"}, 0, None),  # beating
    ]
    for holder, age, why in cases:
        _write_holder(path, age, **holder)
        mine = lease.Lease(path, run_id="me", job_id="42")
        if why is None:
            stop = threading.Event()
            beat = threading.Thread(target=_beating, args=(path, stop, 0.1, 0), daemon=True)
            beat.start()
            try:
                with pytest.raises(lease.LeaseHeld, match=f"run x \\(job 41\\).*remove {path}"):
                    mine.take("checkpoint.save")
            finally:
                stop.set()
                beat.join()
            continue
        note = mine.take("checkpoint.save")
        assert note and why in note and "took over" in note, (holder, note)
        assert json.loads(path.read_text())["run_id"] == "me"
        mine.release()


def _race(path: str, run_id: str, results) -> None:
    try:
        lease.Lease(path, run_id=run_id, job_id=None).take("checkpoint.save")
        results.put(run_id)
        time.sleep(2)  # hold it while the others try
    except lease.LeaseHeld:
        results.put(None)


def test_of_jobs_starting_together_exactly_one_takes_the_lease(tmp_path):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path / lease.WRITER_LEASE), f"r{i}", results))
             for i in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    assert sum(g is not None for g in got) == 1, got


def test_finalize_refuses_a_save_dir_another_run_took_over(tmp_path, monkeypatch):
    old = fake_save(tmp_path, 4)
    (tmp_path / checkpoint.TRACKER).write_text("4\n")
    _write_holder(tmp_path / lease.WRITER_LEASE, 0, run_id="other", host="node7", pid=5)
    staged = checkpoint.staging_dir(tmp_path, 4)
    staged.mkdir()
    (staged / ".metadata").write_bytes(b"mine")
    monkeypatch.setenv(lease.RUN_ID_ENV, "me")
    kept = tmp_path / "iter_0000004.lease-lost.me"
    with pytest.raises(lease.LeaseHeld, match="is now held by run other.*not by this run \\(me\\).*"
                                              f"its complete files are kept as {kept} .*"
                                              "checkpoint.load_iteration=4"):
        checkpoint.finalize_save(tmp_path, 4, staged)
    assert (old / ".metadata").read_bytes() == b"x", "the other run's iter_4 is untouched"
    # issue 59.2: this run's save is kept (never listed, loaded or pruned as a save), not left
    # in the staging dir the other run's save of iteration 4 would remove.
    assert (kept / ".metadata").read_bytes() == b"mine" and not staged.exists()
    assert checkpoint.saved_iterations(tmp_path) == [4]
    staged.mkdir()
    (staged / ".metadata").write_bytes(b"mine")
    monkeypatch.setenv(lease.RUN_ID_ENV, "other")
    checkpoint.finalize_save(tmp_path, 4, staged)
    assert (old / ".metadata").read_bytes() == b"mine"


def test_the_tracker_names_a_replacing_save_before_the_replaced_one_is_removed(tmp_path, monkeypatch):
    fake_save(tmp_path, 4)
    (tmp_path / checkpoint.TRACKER).write_text("2\n")
    staged = checkpoint.staging_dir(tmp_path, 4)
    staged.mkdir()
    (staged / ".metadata").write_bytes(b"new")

    def crash(path, *a, **k):  # the process dies while it removes the replaced save
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.save.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.finalize_save(tmp_path, 4, staged)
    assert checkpoint.read_tracker(tmp_path) == 4
    assert (checkpoint.iter_dir(tmp_path, 4) / ".metadata").read_bytes() == b"new"


@pytest.fixture(scope="module")
def live_job(data_cache, tmp_path_factory):
    """A job that trains for long (train.py, local launch), once it saved iteration 2."""
    out = tmp_path_factory.mktemp("live")
    args = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={out}", "logger=none",
            f"data.cache_dir={data_cache}", "train.train_iters=1000", "optim.lr_warmup_iters=1",
            "checkpoint.save_interval=2"]
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "saved checkpoint at iteration 2" in line:
                break
        yield out, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.e2e
def test_a_second_job_on_a_live_jobs_save_dir_is_refused_before_launch(live_job, train_run,
                                                                       tmp_path):
    out, proc = live_job
    root = out / "checkpoints"
    proc2 = train_run(tmp_path, f"checkpoint.save={root}", rc=2)
    assert re.search(rf"error: checkpoint.save {root} is in use by run \w+, process {proc.pid} "
                     rf"on \S+, last heartbeat at .* \(file time\); .*remove "
                     rf"{root / lease.WRITER_LEASE}",
                     proc2.stdout), proc2.stdout[-2000:]
    assert "worker" not in proc2.stdout
    assert proc.poll() is None, "the first job trains on"
    assert checkpoint.iter_dir(root, 2).is_dir()


@pytest.mark.e2e
def test_ctrl_c_prints_one_line_per_rank_and_names_the_last_complete_checkpoint(live_job):
    out, proc = live_job
    try:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to train.py (the workers are in
        rest = proc.stdout.read()         # sessions of their own: torch's agent stops them)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]
    assert sorted(re.findall(r"> rank (\d): interrupted", rest)) == ["0", "1"], rest[-3000:]
    root = out / "checkpoints"
    last = checkpoint.saved_iterations(root)[-1]
    closing = rest.strip().splitlines()[-1]
    assert closing.startswith(f"> interrupted (SIGINT): the last complete checkpoint is "
                              f"{checkpoint.iter_dir(root, last)}; continue with: python "), closing
    assert closing.endswith("checkpoint.load=auto") and f"hydra.run.dir={out} " in closing


def test_the_other_ranks_of_a_job_refuse_a_save_dir_another_live_job_holds(tmp_path, monkeypatch):
    """Under torchrun/Slurm every rank runs the pre-launch checks; rank 0 takes the lease, the
    others refuse one of another job (and accept their own job's)."""
    from omegaconf import open_dict

    from recipes.run.launch import take_save_dir

    cfg = make_cfg()
    with open_dict(cfg):
        cfg.checkpoint.save = str(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "500")
    _write_holder(tmp_path / lease.WRITER_LEASE, 0, run_id="r0", job_id="500", host="n1", pid=7)
    assert take_save_dir(cfg, is_rank0=False) is None
    import threading

    from test_cluster_races import _beating

    monkeypatch.setattr(lease, "STALE_AFTER_S", 1.0)
    _write_holder(tmp_path / lease.WRITER_LEASE, 0, run_id="r9", job_id="499", host="n1", pid=7)
    assert take_save_dir(cfg, is_rank0=False) is None  # its heartbeat does not move: stale
    stop = threading.Event()
    beat = threading.Thread(target=_beating, args=(tmp_path / lease.WRITER_LEASE, stop, 0.1, 0))
    beat.start()
    try:
        with pytest.raises(lease.LeaseHeld, match=rf"run r9 \(job 499\).*remove "
                                                  rf"{tmp_path / lease.WRITER_LEASE}"):
            take_save_dir(cfg, is_rank0=False)
    finally:
        stop.set()
        beat.join()
