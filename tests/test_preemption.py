"""Cluster life: exit with a save on a signal and ``checkpoint.load=auto``
(recipes/run/preemption.py, recipes/checkpoint/auto.py). One live writer per save dir:
tests/test_save_dir_lease.py."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from compose import make_cfg
from resume_checks import assert_bit_for_bit

from ckpt import io as checkpoint
from recipes.run import preemption
from recipes.metrics.logger import read_metrics
from recipes.checkpoint.auto import resolve_auto_load
from recipes.config.validate import ConfigError

REPO = Path(__file__).resolve().parents[1]
# 12 iterations, a background save every 3: the signal lands while one may be in flight.
RUN = ["train.train_iters=12", "optim.lr_warmup_iters=1", "logger=none",
       "checkpoint.async_save=true", "checkpoint.save_interval=3"]
# Slurm's default grace between SIGTERM and SIGKILL is 30 s (KillWait); --signal=TERM@120 gives 120.
GRACE_S = 30


def fake_save(root: Path, iteration: int) -> Path:
    path = checkpoint.iter_dir(root, iteration)
    path.mkdir(parents=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (path / ".metadata").write_bytes(b"x")
    return path


def _rows(out) -> dict:
    rows, _ = read_metrics(out)
    return {r["iteration"]: r for r in rows}


@pytest.fixture(scope="module")
def preempted(train_jobs, data_cache, tmp_path_factory):
    """The run through train.py sent SIGTERM after iteration 4 (its launcher only, as ``kill
    -TERM`` of train.py); then in one world (tests/helpers/inworld.py) an uninterrupted run and
    the printed command's overrides (``checkpoint.load=auto`` resolved by the same
    ``launch.run_job``; through train.py: the submitit test's requeue)."""
    base = tmp_path_factory.mktemp("preempt")
    out = base / "run"
    args = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={out}",
            f"data.cache_dir={data_cache}", *RUN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"iteration\s+4/12", line):  # the save of 3 may be in flight
                break
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        lines += proc.stdout.readlines()
        proc.wait(GRACE_S * 2)
        seconds = time.time() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = "".join(lines)
    again = re.search(r"continue with: (.*)", stopped)
    assert again, stopped[-3000:]
    cmd = shlex.split(again.group(1))
    assert cmd[0] == "python" and Path(cmd[1]).name == "train.py", cmd
    assert cmd[-1] == "checkpoint.load=auto", cmd
    logged = sorted(_rows(out))
    run_dir = f"hydra.run.dir={out}"
    assert run_dir in cmd, cmd  # the printed command continues in the stopped run's dir
    _, resumed = train_jobs([(base / "ref", RUN), (out, [o for o in cmd[2:] if o != run_dir])])
    return {"ref": base / "ref", "out": out, "rc": proc.returncode, "stopped": stopped,
            "seconds": seconds, "logged": logged, "resumed": resumed}


@pytest.mark.e2e
def test_sigterm_saves_the_iteration_reached_and_exits_0(preempted):
    stopped = preempted["stopped"]
    assert preempted["rc"] == 0, stopped[-3000:]
    found = re.search(r"> exit on SIGTERM after iteration (\d+): checkpoint of iteration \1 saved "
                      r"to (\S+); continue with: ", stopped)
    assert found, stopped[-3000:]
    n = int(found.group(1))
    root = preempted["out"] / "checkpoints"
    assert found.group(2) == str(checkpoint.iter_dir(root, n))
    # No teardown: no traceback, no failed worker.
    assert "Traceback" not in stopped and "failed" not in stopped, stopped[-3000:]
    assert preempted["logged"] == list(range(1, n + 1)), "it stopped at the iteration it saved"
    assert n <= 12 - 3, f"stopped at {n}: too late to compare 3 iterations after the resume"
    assert preempted["seconds"] < 2 * GRACE_S
    print(f"stopped after iteration {n}, {preempted['seconds']:.1f} s after SIGTERM")


@pytest.mark.e2e
def test_the_printed_command_continues_bit_equal_to_an_uninterrupted_run(preempted):
    resumed = preempted["resumed"]
    assert "> checkpoint.load=auto: resuming from" in resumed.stdout, resumed.stdout[-3000:]
    ref, got = _rows(preempted["ref"]), _rows(preempted["out"])
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    n = int(re.search(r"exit on SIGTERM after iteration (\d+)", preempted["stopped"]).group(1))
    assert 12 - n >= 3
    assert_bit_for_bit(got, ref, ref, got_dir=preempted["out"], want_dir=preempted["ref"])
    assert checkpoint.read_tracker(preempted["out"] / "checkpoints") == 12


def _submitit_tasks(sweep: Path) -> list[int]:
    """Pids of the submitit tasks of the sweep into ``sweep`` (not their forks, e.g. an async
    save's writer, which carry the same command line)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            stat = (cmdline.parent / "stat").read_text()
        except OSError:
            continue
        if b"submitit.core._submit" in args and any(str(sweep).encode() in a for a in args):
            found[int(cmdline.parent.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


@pytest.mark.e2e
def test_submitit_preemption_saves_requeues_and_resumes_bit_equal(preempted, data_cache, tmp_path):
    """submitit's preemption signal (USR2, as its local executor and Slurm send it) to the
    tasks of a submitit_local job after iteration 4: the job saves, submitit requeues it, the
    requeued job (checkpoint.load defaults to auto) resumes and finishes with the figures of an
    uninterrupted run."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={sweep}",
            "hydra/launcher=submitit_local", "hydra.sweep.subdir=${hydra.job.num}",
            f"data.cache_dir={data_cache}", *RUN]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            logs = list(sweep.glob(".submitit/*/*_0_log.out"))
            if logs and re.search(r"iteration\s+4/12", logs[0].read_text()):
                break
            time.sleep(0.2)
        tasks = _submitit_tasks(sweep)
        assert len(tasks) == 2, tasks
        for pid in tasks:
            os.kill(pid, signal.SIGUSR2)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    log = "".join(p.read_text() for p in sorted(sweep.glob(".submitit/*/*_0_log.*")))
    found = re.search(r"> exit on SIGUSR2 after iteration (\d+): checkpoint of iteration \1 saved", log)
    assert found, log[-3000:]
    assert "continue with" not in log  # submitit requeues it
    assert re.search(r"Requeued job \S+", log), log[-3000:]
    n = int(found.group(1))
    assert n <= 9
    rows, events = read_metrics(sweep / "0")
    assert [(e["event"], e["iteration"]) for e in events if e["event"] != "save"] == [
        ("start", 0), ("resume", n)]
    ref = _rows(preempted["ref"])
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    assert_bit_for_bit({r["iteration"]: r for r in rows}, ref, ref,
                       ("lm loss", "grad-norm", "learning-rate"), got_dir=sweep / "0",
                       want_dir=preempted["ref"])


# --- the exit decision without processes ----------------------------------------------------

@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_exit_reasons_signal_duration_interval(handlers, monkeypatch):
    train = make_cfg("train.exit_signal=SIGUSR1").train
    preemption.install(train)
    assert preemption.exit_reason(5, train) is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.exit_reason(5, train) == "SIGUSR1"
    preemption.install(make_cfg().train)
    assert preemption.exit_reason(5, make_cfg().train) is None
    # SIGTERM is noted (not fatal) whatever train.exit_signal is.
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.exit_reason(1, make_cfg().train) == "SIGTERM"
    preemption.install(make_cfg().train)
    interval = make_cfg("train.exit_interval=4").train
    assert [preemption.exit_reason(i, interval) for i in (3, 4)] == [None, "train.exit_interval=4"]
    duration = make_cfg("train.exit_duration_in_mins=1.5").train
    assert preemption.exit_reason(1, duration) is None
    monkeypatch.setattr(preemption, "_started", time.time() - 91)
    assert preemption.exit_reason(1, duration) == "train.exit_duration_in_mins=1.5"


def test_under_submitit_its_signal_is_handled_and_its_handler_runs_after_the_save(handlers, monkeypatch):
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "123")
    called = []
    signal.signal(signal.SIGUSR2, lambda s, f: called.append(s))  # submitit's requeue handler
    train = make_cfg().train
    assert preemption.exit_signals(train) == [signal.SIGTERM, signal.SIGUSR2]
    preemption.install(train)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert called == [] and preemption.exit_reason(1, train) == "SIGUSR2"
    preemption.after_exit()
    assert called == [signal.SIGUSR2]


def test_bad_exit_fields_fail_before_launch():
    from recipes.config.validate import validate

    with pytest.raises(ConfigError, match=r"train.exit_signal='SIGKILL': valid are"):
        validate(make_cfg("train.exit_signal=SIGKILL"), 2)
    with pytest.raises(ConfigError, match=r"train.exit_interval=0 must be > 0"):
        validate(make_cfg("train.exit_interval=0"), 2)


def test_the_continue_command_pins_the_run_dir_and_loads_auto():
    cmd = preemption.continue_command(["train.py", "parallelism=tp2", "checkpoint.load=/x",
                                       "checkpoint.load_iteration=4", "data.paths=[a b]"], "/o/1")
    assert cmd == ("python train.py parallelism=tp2 'data.paths=[a b]' hydra.run.dir=/o/1 "
                   "checkpoint.load=auto")
    assert "hydra.run.dir=/o/1" not in preemption.continue_command(
        ["train.py", "hydra.run.dir=/mine"], "/o/1")


# --- checkpoint.load=auto -------------------------------------------------------------------

def test_load_auto_takes_the_newest_complete_save_and_rewrites_a_tracker_left_behind(tmp_path,
                                                                                    monkeypatch):
    from omegaconf import open_dict

    from ckpt.io import manager
    from recipes.checkpoint.policy import check_save_dir

    # Stand-in saves of one lineage (tests/test_requeue_lineage.py loads real ones).
    monkeypatch.setattr(manager, "load_common",
                        lambda root, it: (None, {"train_state": {"lineage": [["r", 0]]}}))

    root = tmp_path / "ck"
    fake_save(root, 3)
    fake_save(root, 6)
    checkpoint.staging_dir(root, 9).mkdir()  # an interrupted save: never loaded
    (root / checkpoint.TRACKER).write_text("3\n")
    cfg = make_cfg("checkpoint.load=auto", "checkpoint.verify_on_load=false")
    with open_dict(cfg):
        cfg.checkpoint.save = str(root)
    note = resolve_auto_load(cfg)
    assert (cfg.checkpoint.load, cfg.checkpoint.load_iteration) == (str(root), 6)
    assert checkpoint.read_tracker(root) == 6
    assert "resuming from" in note and "named 3; rewritten to 6" in note
    check_save_dir(cfg.checkpoint, 6)  # continuing its own dir: not "another run's"


def test_load_auto_starts_fresh_without_a_save_and_needs_a_save_dir(tmp_path):
    from omegaconf import open_dict

    for root in (tmp_path / "missing", tmp_path):
        cfg = make_cfg("checkpoint.load=auto")
        with open_dict(cfg):
            cfg.checkpoint.save = str(root)
        assert "starting from iteration 0" in resolve_auto_load(cfg)
        assert cfg.checkpoint.load is None
    with pytest.raises(ConfigError, match="checkpoint.load=auto .* checkpoint.save, which is null"):
        resolve_auto_load(make_cfg("checkpoint.load=auto"))
    cfg = make_cfg("checkpoint.load=auto", "checkpoint.load_iteration=3")
    with open_dict(cfg):
        cfg.checkpoint.save = str(tmp_path)
    with pytest.raises(ConfigError, match="checkpoint.load_iteration=3 set checkpoint.load="):
        resolve_auto_load(cfg)


def test_load_defaults_to_auto_under_the_submitit_launchers():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from compose import CONF

    for launcher, want in (("submitit_local", "auto"), ("slurm", "auto"), ("basic", None)):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("config", return_hydra_config=True,
                          overrides=[f"hydra/launcher={launcher}", "hydra.sweep.dir=/tmp/x",
                                     "hydra.job.name=t", "hydra.runtime.output_dir=/tmp/x"])
        HydraConfig.instance().set_config(cfg)
        try:
            assert OmegaConf.select(cfg, "checkpoint.load") == want, launcher
        finally:
            HydraConfig.instance().cfg = None
