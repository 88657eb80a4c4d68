"""Checkpoint policy without training (the resume diff and what a resume takes from the
checkpoint: tests/test_resume_config.py): staged saves, save-dir claims, the agreed load iteration,
retention, bad checkpoint paths, restricted metadata, collective devices."""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from compose import make_cfg
from multiproc import run_distributed

from ckpt import io as checkpoint
from recipes.checkpoint import policy as checkpointer
from ckpt.io import manager
from ckpt.io import CheckpointError


def fake_save(root: Path, iteration: int, payload: bytes = b"x") -> Path:
    """An iter dir that looks complete to the policy (megatron's two metadata files)."""
    path = checkpoint.iter_dir(root, iteration)
    path.mkdir(parents=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (path / ".metadata").write_bytes(payload)
    return path


def ck_cfg(**fields):
    cfg = make_cfg()
    for key, value in fields.items():
        cfg.checkpoint[key] = value
    return cfg.checkpoint


@pytest.fixture(scope="module")
def train_checkpoint(train_jobs, tmp_path_factory):
    """A dp2 run of 2 iterations saved at 1 and 2 (an in-world job); its checkpoint dir."""
    out = tmp_path_factory.mktemp("ckpt_src")
    train_jobs([(out, ["train.train_iters=2", "checkpoint.save_interval=1"])])
    return str(out / "checkpoints")


# --- 1. a save never deletes or hides a complete checkpoint ---------------------------------

def test_staged_save_replaces_an_existing_iteration_only_when_complete(tmp_path):
    old = fake_save(tmp_path, 50, b"old")
    (tmp_path / checkpoint.TRACKER).write_text("100\n")
    staged = checkpoint.staging_dir(tmp_path, 50)
    staged.mkdir()
    (staged / ".metadata").write_bytes(b"new")
    # Until finalize, the old checkpoint is untouched and nothing lists the staged dir.
    assert (old / ".metadata").read_bytes() == b"old"
    assert checkpoint.saved_iterations(tmp_path) == [50]
    checkpoint.finalize_save(tmp_path, 50, staged)
    assert (old / ".metadata").read_bytes() == b"new"
    assert not staged.exists() and not list(tmp_path.glob(".*replaced"))


def test_a_crash_between_the_two_renames_is_recovered(tmp_path):
    fake_save(tmp_path, 50, b"old")
    aside = tmp_path / ".iter_0000050.replaced"
    checkpoint.iter_dir(tmp_path, 50).rename(aside)  # as finalize_save, killed after its 1st rename
    assert checkpoint.recover_replaced(tmp_path) == [checkpoint.iter_dir(tmp_path, 50)]
    assert (checkpoint.iter_dir(tmp_path, 50) / ".metadata").read_bytes() == b"old"


def test_an_occupied_save_dir_is_refused_naming_the_ways_on(tmp_path):
    root = tmp_path / "ck"
    fake_save(root, 50)
    fake_save(root, 100)
    (root / checkpoint.TRACKER).write_text("100\n")
    # A re-submitted job (no load) and a fork (an earlier iteration of the same dir).
    for ck, loaded in ((ck_cfg(save=str(root)), None),
                       (ck_cfg(save=str(root), load=str(root), load_iteration=50), 50)):
        with pytest.raises(CheckpointError, match=r"already holds another run's checkpoints .*"
                                                  r"iterations \[50, 100\], tracker at 100.*"
                                                  r"checkpoint.save=OTHER_DIR.*allow_existing_save"):
            checkpointer.check_save_dir(ck, loaded)
    # Continuing the dir from its newest save, or asking for it, is fine.
    checkpointer.check_save_dir(ck_cfg(save=str(root), load=str(root)), 100)
    checkpointer.check_save_dir(ck_cfg(save=str(root), allow_existing_save=True), None)
    checkpointer.check_save_dir(ck_cfg(save=str(tmp_path / "fresh")), None)


def test_an_unwritable_save_dir_is_refused_before_launch(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"checkpoint.save='.*file/ck' is not writable"):
        checkpointer.check_save_dir(ck_cfg(save=str(tmp_path / "file" / "ck")), None)


def test_load_iteration_newer_than_the_tracker_loads_when_complete(tmp_path, monkeypatch):
    # A complete save is loadable by its iteration even after the tracker moved back (a fork
    # saving into the dir with allow_existing_save).
    fake_save(tmp_path, 50)
    fake_save(tmp_path, 100)
    (tmp_path / checkpoint.TRACKER).write_text("50\n")
    monkeypatch.setattr(checkpoint.integrity, "check_storage", lambda path: None)  # fake files: no tensors
    assert checkpoint.check_loadable(tmp_path, 100).name == "iter_0000100"


# --- 2. every rank loads the iteration rank 0 resolved --------------------------------------

def _agree_while_tracker_moves(root):
    from compose import make_cfg

    from ckpt import io as ckpt
    from recipes.checkpoint import policy

    rank = torch.distributed.get_rank()
    # A live writer moves the tracker between the ranks' reads: each rank would read another.
    ckpt.integrity.read_tracker = lambda path: 10 + rank
    ckpt.integrity.check_storage = lambda path: None  # fake files hold no tensors
    ck = make_cfg().checkpoint
    ck.load = root
    return policy.agree_load_iteration(ck)


def _distributed_checks(root):
    """The checks that need a process group, in one 2-rank world (start-up is the cost)."""
    return {"agree": _agree_while_tracker_moves(root), "devices": _collectives_under_nccl_rule(),
            "same_run": _check_same_run()}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    for it in (10, 11):
        fake_save(root, it)
    return run_distributed(_distributed_checks, 2, str(root), timeout=300)


def test_every_rank_loads_the_same_iteration_while_the_tracker_moves(distributed):
    assert [r["agree"] for r in distributed] == [10, 10]


def test_nothing_to_train_when_the_checkpoint_is_at_the_end(train_checkpoint):
    cfg = make_cfg("train.train_iters=2", f"checkpoint.load={train_checkpoint}")
    with pytest.raises(checkpointer.NothingToTrain, match="at iteration 2 and train.train_iters=2"):
        checkpointer.prepare_resume(cfg, None)


def test_stock_layout_refuses_a_checkpoint_of_another_layout(train_checkpoint):
    from recipes.config.validate import validate

    cfg = make_cfg("parallelism=tp2dp2", "gtp=tp2_align16", "gtp.checkpoint_layout=stock",
                   "train.train_iters=4", "optim.lr_warmup_iters=1",
                   f"checkpoint.load={train_checkpoint}")
    parallel_dims = validate(cfg, 4)
    with pytest.raises(CheckpointError, match="use checkpoint.format=logical"):
        checkpointer.prepare_resume(cfg, parallel_dims)


def test_resume_pins_the_iteration_and_records_the_schedule_that_runs(train_checkpoint):
    from recipes.config.validate import validate

    cfg = make_cfg("train.train_iters=4", "optim.lr=5e-4", "optim.lr_warmup_iters=1",
                   f"checkpoint.load={train_checkpoint}")
    checkpointer.prepare_resume(cfg, validate(cfg, 2))
    assert cfg.checkpoint.load_iteration == 2
    assert (cfg.optim.lr, cfg.optim.lr_decay_iters) == (0.003, 2)  # the checkpoint's
    refused = make_cfg("train.train_iters=4", "train.seed=9", "optim.lr_warmup_iters=1",
                       f"checkpoint.load={train_checkpoint}")
    with pytest.raises(CheckpointError, match=r"train.seed 1234 -> 9 .*allow_data_change=true"):
        checkpointer.prepare_resume(refused, validate(refused, 2))


# --- 9. loading runs no pickled code --------------------------------------------------------

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_metadata_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "payload_ran"
    fake_save(tmp_path, 1, pickle.dumps(_Payload(marker)))
    (tmp_path / checkpoint.TRACKER).write_text("1\n")
    with pytest.raises(CheckpointError, match=r"names pathlib.Path.touch.*refusing"):
        checkpoint.check_loadable(tmp_path)
    assert not marker.exists()


def test_our_own_checkpoint_objects_load_with_weights_only(train_checkpoint):
    from megatron.core import dist_checkpointing

    from ckpt.io.state import rng_state

    common = dist_checkpointing.load_common_state_dict(str(Path(train_checkpoint) / "iter_0000002"))
    ours = {k: common[k] for k in ("iteration", "train_state", "layout", "opt_param_scheduler")}
    for obj in (ours, rng_state()):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)


# --- 10. bad checkpoint paths and trackers --------------------------------------------------

def test_bad_checkpoint_paths_are_named(tmp_path):
    fake_save(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"is one saved iteration.*checkpoint.load='.*' "
                                              r"checkpoint.load_iteration=2"):
        checkpoint.read_tracker(checkpoint.iter_dir(tmp_path, 2))
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        checkpoint.read_tracker(tmp_path / "f")
    (tmp_path / checkpoint.TRACKER).write_bytes(b"\xff\xfe2\n")
    with pytest.raises(CheckpointError, match=r"expected an iteration number, found b'\\xff"):
        checkpoint.read_tracker(tmp_path)


# --- 12. retention counts complete saves only -----------------------------------------------

def test_keep_last_never_counts_incomplete_dirs(tmp_path):
    for it in (1, 2, 3):
        fake_save(tmp_path, it)
    checkpoint.iter_dir(tmp_path, 4).mkdir()  # no metadata: not a save
    (tmp_path / checkpoint.TRACKER).write_text("3\n")
    removed = checkpoint.remove_old_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["iter_0000001"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000003",
                                                                "iter_0000004"]


def test_tracker_is_written_through_a_unique_temp_file(tmp_path, monkeypatch):
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    checkpoint.write_durable(tmp_path / checkpoint.TRACKER, "5\n")
    assert (tmp_path / checkpoint.TRACKER).read_text() == "5\n"
    assert len(synced) == 2  # the file and its dir
    assert not list(tmp_path.glob("*.tmp"))


# --- 3. collectives use the device their group's backend needs ------------------------------

def _collectives_under_nccl_rule():
    """Stand-in for NCCL's rule: the group needs one device, and a tensor whose code did not
    choose a device lands on another. Here the group is gloo (needs CPU) and the default device
    is 'meta': a tensor created without ``collective_device`` reaches the collective on 'meta'."""
    import torch.distributed as dist

    from ckpt import io as ckpt
    from recipes.data.datasets import _rank0_first
    from gtp.collectives import any_rank_failed, collective_device

    originals = {}

    def checked(name):
        real = getattr(dist, name)
        originals[name] = real

        def call(tensor, *args, **kwargs):
            group = kwargs.get("group")
            if tensor.device != collective_device(group):
                raise AssertionError(f"{name}: tensor on {tensor.device}, its group needs "
                                     f"{collective_device(group)}")
            return real(tensor, *args, **kwargs)
        return call

    for name in ("all_reduce", "broadcast"):
        setattr(dist, name, checked(name))
    torch.set_default_device("meta")
    try:
        state = {"w": torch.zeros(3, device="cpu")}
        ckpt.expected_checkpoint_bytes(state)
        any_rank_failed(False)
        _rank0_first(lambda: 1)
        from gtp.grad_stats import grad_norms_by_part

        grad_norms_by_part([([("decoder.layers.0.mlp.linear_fc1.weight",
                               torch.nn.Parameter(torch.zeros(2, device="cpu")))], 0)], 1, None)
    finally:
        torch.set_default_device("cpu")
        for name, real in originals.items():
            setattr(dist, name, real)
    return "ok"


def test_collectives_use_the_device_their_backend_needs(distributed):
    assert [r["devices"] for r in distributed] == ["ok", "ok"], distributed


def test_gtp_inspect_refuses_crafted_metadata_without_running_it(tmp_path, capsys):
    from ckpt.cli import main

    marker = tmp_path / "payload_ran"
    fake_save(tmp_path, 1, pickle.dumps(_Payload(marker)))
    (tmp_path / checkpoint.TRACKER).write_text("1\n")
    assert main(["inspect", str(tmp_path)], out=io.StringIO()) == 2
    assert "refusing to load it" in capsys.readouterr().err
    assert not marker.exists()


# --- 7. torchrun/Slurm: one run dir, one writer ---------------------------------------------

def test_many_writers_of_the_resolved_config_never_collide(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from recipes.run.launch import write_resolved_config

    cfg = make_cfg()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: write_resolved_config(cfg, str(tmp_path)), range(32)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resolved_config.yaml"]


def _check_same_run():
    from compose import make_cfg

    from recipes.run.worker import check_same_run

    rank = torch.distributed.get_rank()
    cfg = make_cfg(f"output_dir=/runs/12-00-0{rank}")  # ${now:...} resolved a second apart
    from recipes.config.validate import ConfigError

    try:
        check_same_run(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def test_ranks_that_resolved_different_run_dirs_stop_before_training(distributed):
    errors = [r["same_run"] for r in distributed]
    assert all(e and "resolved different run dirs" in e and "/runs/12-00-01" in e for e in errors), errors


def test_a_job_dir_is_claimed_by_one_live_run(tmp_path, monkeypatch):
    import json
    import os

    from recipes.run.launch import CLAIM, claim_job_dir
    from recipes.config.validate import ConfigError

    claim_job_dir(tmp_path)
    assert json.loads((tmp_path / CLAIM).read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=f"job dir {tmp_path} is in use by run .*process "
                                          f"{os.getpid()}.*remove {tmp_path / CLAIM}"):
        claim_job_dir(tmp_path)
    # A claim whose process is gone is taken over (also one in the older "HOST PID" form).
    (tmp_path / CLAIM).write_text(f"{os.uname().nodename} 999999999\n")
    assert "its process is gone" in claim_job_dir(tmp_path)
    # One from another host: taken over when it is this same job (a requeue) once its
    # heartbeat stopped (watched), else refused while it beats.
    import threading

    from test_cluster_races import _beating

    from ckpt.io import lease

    monkeypatch.setattr(lease, "STALE_AFTER_S", 0.5)
    (tmp_path / CLAIM).write_text(json.dumps({"run_id": "r", "job_id": "77", "host": "n9", "pid": 1}))
    os.environ["SLURM_JOB_ID"] = "77"
    try:
        assert "(this job, 77, before a requeue)" in claim_job_dir(tmp_path)
        (tmp_path / CLAIM).write_text(json.dumps({"run_id": "r", "job_id": "78", "host": "n9", "pid": 1}))
        stop = threading.Event()  # another job whose heartbeat moves: live
        beat = threading.Thread(target=_beating, args=(tmp_path / CLAIM, stop, 0.05, 0))
        beat.start()
        try:
            with pytest.raises(ConfigError, match=f"job 78.* on n9.*remove {tmp_path / CLAIM}"):
                claim_job_dir(tmp_path)
        finally:
            stop.set()
            beat.join()
    finally:
        del os.environ["SLURM_JOB_ID"]
    (tmp_path / CLAIM).unlink()


@pytest.mark.parametrize("keep_last", [None, 3])
def test_the_moves_back_note_reads_the_tracker_after_the_save_in_flight(tmp_path, monkeypatch,
                                                                          capsys, keep_last):
    """With async saves the tracker the note compares against is the one the save still in
    flight leaves, not the one before it (a resumed-over dir at 12, saves at 1 then 2: only
    the first moves the tracker back)."""
    fake_save(tmp_path, 12)
    (tmp_path / checkpoint.TRACKER).write_text("12\n")
    pending = []

    class InFlight:  # megatron's async queue: a save completes in a later wait()
        def wait(self):
            while pending:
                pending.pop(0)()

    def stage_save(root, iteration, *args, async_saves=None, on_written=None):
        staged = checkpoint.staging_dir(root, iteration)
        async_saves.wait()
        pending.append(lambda: on_written(staged))
        return staged

    def finalize_save(root, iteration, staged, chain=None):
        fake_save(Path(root), iteration)
        (Path(root) / checkpoint.TRACKER).write_text(f"{iteration}\n")
        return checkpoint.iter_dir(root, iteration)

    monkeypatch.setattr(manager, "stage_save", stage_save)
    monkeypatch.setattr(manager, "finalize_save", finalize_save)
    monkeypatch.setattr(manager, "job_id", lambda: None)
    monkeypatch.setattr(manager, "collective_device", lambda *a: torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: None)
    saver = manager.CheckpointManager(ck_cfg(save=str(tmp_path), keep_last=keep_last))
    saver.async_saves = InFlight()
    for iteration in (1, 2):
        saver.save(SimpleNamespace(iteration=iteration, model=None, optimizer=None,
                                   scheduler=None, consumed_samples=0, skipped=0, train_state={}))
    saver.wait()
    notes = [line for line in capsys.readouterr().out.splitlines() if "moves back" in line]
    assert notes == [f"> note: {checkpoint.TRACKER} in {tmp_path} moves back from 12 to 1; "
                     f"iter_0000012 stays (checkpoint.load_iteration=12 loads it) unless this "
                     f"run saves iteration 12 too, which replaces it"
                     + (f", or checkpoint.keep_last={keep_last} removes it once {keep_last} "
                        f"newer complete save(s) exist" if keep_last else "")]


def test_a_torn_metadata_file_is_named_with_what_to_do(tmp_path):
    fake_save(tmp_path, 5, payload=bytes(range(7, 200)))
    (tmp_path / checkpoint.TRACKER).write_text("5\n")
    with pytest.raises(CheckpointError, match=(
            rf"^{tmp_path}/iter_0000005/\.metadata cannot be read \(\w+: .*\): it is torn or not "
            rf"a torch_dist checkpoint's metadata; load another iteration "
            rf"\(checkpoint.load_iteration=N\) or another checkpoint.load$")):
        checkpoint.check_loadable(tmp_path)
