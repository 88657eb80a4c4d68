"""Crash-safe checkpoints, no hangs, retention, deterministic resume, disk space."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt import io as checkpoint
from ckpt.io import CheckpointError
from recipes.metrics.logger import read_metrics

COMMON = ["train.train_iters=6", "optim.lr_warmup_iters=1", "checkpoint.save_interval=2"]


def metrics(run_dir) -> dict:
    return {r["iteration"]: r for r in read_metrics(run_dir)[0]}


def same(a: dict, b: dict) -> bool:
    keys = ("lm loss", "grad-norm", "learning-rate", "consumed-samples", "num-zeros")
    return all(a[k] == b[k] for k in keys)


def tree(root: Path) -> dict:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def crashed(train_run, tmp_path_factory):
    """A run whose rank 1 is SIGKILLed while it writes its files of iteration 4 (a save that
    replaces nothing)."""
    out = tmp_path_factory.mktemp("crash") / "a"
    proc = train_run(out, *COMMON, rc=1, env={"GTP_RECIPES_FAULT": "kill:write:4:1"})
    return out, proc


# The jobs of this file that succeed, in one world (tests/helpers/inworld.py), one after the
# other: name -> overrides. "b1", "b2" also load the crashed run's checkpoints.
JOBS = {
    "b1": COMMON, "b2": COMMON,  # two resumes of the crashed run
    "keep_last": ["train.train_iters=4", "optim.lr_warmup_iters=1", "checkpoint.save_interval=1",
                  "checkpoint.keep_last=2"],
    "damaged": ["train.train_iters=2", "optim.lr_warmup_iters=1", "checkpoint.save_interval=1"],
    "skip_nonfinite": ["train.train_iters=4", "optim.lr=1e30", "optim.lr_warmup_iters=0",
                       "checkpoint.save_interval=0", "train.skip_nonfinite_iterations=true"],
}


@pytest.fixture(scope="module")
def jobs(crashed, train_jobs, tmp_path_factory) -> dict:
    """name -> run dir of every job of :data:`JOBS`, trained in one world."""
    out, _ = crashed
    root = tmp_path_factory.mktemp("jobs")
    load = [f"checkpoint.load={out}/checkpoints"]
    train_jobs([(root / name, [*overrides, *(load if name in ("b1", "b2") else [])])
                for name, overrides in JOBS.items()])
    return {name: root / name for name in JOBS}


@pytest.fixture(scope="module")
def resumed(jobs):
    """Two resumes of the crashed run from its last complete save (iteration 2) to 6, one after
    the other in one world."""
    return jobs["b1"], jobs["b2"]


def test_kill_during_save_fails_the_job_and_keeps_the_last_complete_checkpoint(crashed):
    out, proc = crashed
    assert "injected fault kill:write:4:1" in proc.stdout
    assert re.search(r"error: worker rank 1 failed \(exit code -9\)", proc.stdout), proc.stdout[-2000:]
    root = out / "checkpoints"
    assert checkpoint.read_tracker(root) == 2, "the tracker must still name the last complete save"
    # The interrupted save was staged beside: nothing that looks like a checkpoint of 4.
    assert not (root / "iter_0000004").exists()
    assert checkpoint.saved_iterations(root) == [2]
    assert list(checkpoint.staging_dir(root, 4).glob("*.distcp"))


def test_resume_after_crash_is_exact_and_deterministic(crashed, resumed):
    out, _ = crashed
    resumed_dirs = resumed
    before = metrics(out)
    assert sorted(before) == [1, 2, 3, 4], "the crashed run logged iterations 1-4"
    resumed = [metrics(path) for path in resumed]
    assert sorted(resumed[0]) == [3, 4, 5, 6]
    # Same layout, RNG and data position restored: bit-identical figures.
    for it in (3, 4, 5, 6):
        assert same(resumed[0][it], resumed[1][it]), it
    for it in (3, 4):
        assert same(resumed[0][it], before[it]), it
    # The resumed job rewrote iteration 4 from scratch and completed it.
    assert checkpoint.read_tracker(resumed_dirs[0] / "checkpoints") == 6


# A worker that raises or dies must end the job within this many seconds (measured from the fault
# to the launcher's exit): the elastic agent polls every 0.5 s, then stops the other workers.
FAILURE_EXIT_BOUND_S = 30


def test_worker_error_ends_the_job_fast_with_that_rank_error_first(train_run, tmp_path):
    proc = train_run(tmp_path, "train.train_iters=200", "optim.lr_warmup_iters=1",
                     "checkpoint.save_interval=0", "checkpoint.save_at_end=false", rc=1,
                     env={"GTP_RECIPES_FAULT": "raise:train:2:1"})
    ended = time.time()
    fault_at = float(re.search(r"injected fault \S+ at unix time ([\d.]+)", proc.stdout).group(1))
    tail = proc.stdout[proc.stdout.index("error: worker rank"):]
    assert tail.startswith("error: worker rank 1 failed"), tail[:500]
    assert "injected fault" in tail.splitlines()[1], tail[:500]
    # Rank 0 sat in a gloo collective waiting for rank 1; it must not keep the job alive.
    assert ended - fault_at < FAILURE_EXIT_BOUND_S, ended - fault_at
    print(f"job ended {ended - fault_at:.1f} s after the fault")
    rows, _ = read_metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2][: len(rows)]


def test_keep_last_removes_only_older_complete_checkpoints(jobs):
    root = jobs["keep_last"] / "checkpoints"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert checkpoint.read_tracker(root) == 4


def test_retention_never_touches_the_tracked_or_an_in_progress_save(tmp_path):
    for it in (1, 2, 3, 4, 5):
        checkpoint.iter_dir(tmp_path, it).mkdir()
        if it != 5:  # 5 lacks megatron's metadata: an incomplete dir (e.g. an older crash)
            (checkpoint.iter_dir(tmp_path, it) / "metadata.json").write_text("{}")
            (checkpoint.iter_dir(tmp_path, it) / ".metadata").write_bytes(b"")
    (tmp_path / checkpoint.TRACKER).write_text("4\n")
    removed = checkpoint.remove_old_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000005"]


def test_save_that_cannot_fit_is_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match=r"not enough disk space .* 1\.0 MiB free, about 110\.\d MiB needed"):
        checkpoint.ensure_disk_space(tmp_path / "ckpt", 100 << 20, free_bytes=1 << 20)
    assert not (tmp_path / "ckpt").exists()
    checkpoint.ensure_disk_space(tmp_path / "ckpt", 1 << 20, free_bytes=1 << 30)


def test_damaged_checkpoints_are_named(jobs):
    root = jobs["damaged"] / "checkpoints"  # this test's own: it damages it
    # A tracker naming an iteration that is not there.
    (root / checkpoint.TRACKER).write_text("7\n")
    with pytest.raises(CheckpointError, match="names iteration 7 but .*iter_0000007 is missing"):
        checkpoint.check_loadable(root)
    (root / checkpoint.TRACKER).write_text("2\n")
    # A missing .metadata.
    (root / "iter_0000001" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000001 is incomplete: \.metadata is missing"):
        checkpoint.check_loadable(root, 1)
    # A truncated tensor file.
    data = sorted((root / "iter_0000002").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=re.escape(data.name) + r" has \d+ bytes.*truncated"):
        checkpoint.check_loadable(root)


def test_root_cause_is_reported_first_whatever_the_timing():
    """A killed rank comes before a rank that then lost its peer, even if the latter's error file
    is older; a raising rank comes before ranks the launcher stopped or that lost their peer."""
    from types import SimpleNamespace as F

    from recipes.run.launch import _failure_order

    killed = F(exitcode=-9, error_file_data=None, message="Signal 9", timestamp=20)
    peer = F(exitcode=1, error_file_data={"m": 1}, timestamp=10,
             message="RuntimeError: gloo Read error: Connection reset by peer")
    stopped = F(exitcode=-15, error_file_data=None, message="Signal 15", timestamp=5)
    raised = F(exitcode=1, error_file_data={"m": 1}, message="RuntimeError: boom", timestamp=8)
    order = lambda fs: [r for r, f in sorted(fs.items(), key=lambda i: _failure_order(*i))]
    assert order({0: peer, 1: killed}) == [1, 0]
    assert order({0: stopped, 1: raised, 2: peer}) == [1, 0, 2]
    assert order({0: peer, 1: raised})[0] == 1


def test_kill_while_rewriting_an_existing_iteration_keeps_it_whole(resumed, train_run, tmp_path):
    """A fork saving into the dir it loads from (allowed explicitly) is killed while it writes
    iteration 6, which already exists complete: the old iteration 6 is untouched and loads."""
    root = resumed[1] / "checkpoints"
    before = tree(root)
    proc = train_run(tmp_path, *COMMON, f"checkpoint.load={root}", "checkpoint.load_iteration=4",
                     f"checkpoint.save={root}", "checkpoint.allow_existing_save=true", rc=1,
                     env={"GTP_RECIPES_FAULT": "kill:write:6:1"})
    assert "injected fault kill:write:6:1" in proc.stdout
    after = tree(root)
    # Hidden: the writer lease and the killed save's staging dir (the lineage record unchanged).
    assert {k: v for k, v in after.items() if not k.startswith(".")} == {
        k: v for k, v in before.items() if not k.startswith(".")}
    assert after[".lineage.json"] == before[".lineage.json"]
    assert checkpoint.read_tracker(root) == 6
    checkpoint.check_loadable(root, 6)


def test_a_second_run_into_an_occupied_save_dir_is_refused_before_launch(resumed, train_run, tmp_path):
    root = resumed[0] / "checkpoints"
    before = tree(root)
    proc = train_run(tmp_path, *COMMON, f"checkpoint.save={root}", rc=2)
    assert f"error: checkpoint.save='{root}' already holds another run's checkpoints" in proc.stdout
    assert "checkpoint.load=" in proc.stdout and "checkpoint.save=OTHER_DIR" in proc.stdout
    assert "worker" not in proc.stdout
    assert tree(root) == before


def test_the_launcher_pins_the_iteration_every_rank_loads(resumed):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(resumed[0] / "resolved_config.yaml")
    assert cfg.checkpoint.load_iteration == 2


def test_a_non_finite_loss_stops_before_the_step_naming_the_last_good_checkpoint(train_run, tmp_path):
    proc = train_run(tmp_path, "train.train_iters=6", "optim.lr=1e30", "optim.lr_warmup_iters=0",
                     "checkpoint.save_interval=1", rc=1)
    found = re.search(r"iteration (\d+): lm loss (\S+), grad-norm (\S+): not finite; the step "
                      r"was not applied and the run stops. Last good checkpoint: (\S+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    bad = int(found.group(1))
    root = tmp_path / "checkpoints"
    assert found.group(4) == str(checkpoint.iter_dir(root, bad - 1))
    assert checkpoint.read_tracker(root) == bad - 1
    assert checkpoint.saved_iterations(root) == list(range(1, bad))
    rows = metrics(tmp_path)
    assert sorted(rows) == list(range(1, bad + 1))
    assert rows[bad]["skipped-iterations"] == 1


def test_skip_nonfinite_iterations_counts_and_never_saves_them(jobs):
    import math

    rows = metrics(jobs["skip_nonfinite"])
    bad = [it for it, r in rows.items() if not (math.isfinite(r["lm loss"]) and math.isfinite(r["grad-norm"]))]
    assert bad, "lr=1e30 must blow up"
    assert rows[4]["skipped-iterations"] == len(bad)
    assert all(math.isnan(rows[it]["num-zeros"]) for it in bad)



def test_saves_and_loads_run_with_the_cyclic_gc_paused_and_restore_it():
    """A full collection walks every object of the training process; a save or load must not
    start one, and must leave the collector as it found it (also when it fails)."""
    import gc

    seen = []

    def body(fail: bool):
        seen.append(gc.isenabled())
        if fail:
            raise CheckpointError("stop here")
        return "done"

    paused = checkpoint.save.gc_paused(body)
    assert gc.isenabled()
    assert paused(False) == "done" and gc.isenabled()
    with pytest.raises(CheckpointError, match="stop here"):
        paused(True)
    assert gc.isenabled() and seen == [False, False]
    gc.disable()
    try:  # a caller that paused it already finds it paused afterwards
        paused(False)
        assert not gc.isenabled()
    finally:
        gc.enable()
    # Both entry points are wrapped (every wrapper shares the one code object).
    for fn in (checkpoint.stage_save, checkpoint.load_checkpoint):
        assert fn.__code__ is paused.__code__, fn.__name__


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killing_the_launcher_kills_its_workers(data_cache, tmp_path):
    """``kill -9`` of train.py: its workers (in sessions of their own, out of reach of a
    process-group kill) die with it instead of training on into the job dir."""
    repo = Path(__file__).resolve().parents[1]
    args = [sys.executable, str(repo / "train.py"), f"hydra.run.dir={tmp_path}", "logger=none",
            f"data.cache_dir={data_cache}", "parallelism=dp2", "train.train_iters=100000",
            "optim.lr_warmup_iters=1", "checkpoint.save_interval=0",
            "checkpoint.save_at_end=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        for line in launcher.stdout:  # until the workers train
            if re.search(r"iteration\s+2/", line):
                break
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.kill()
        launcher.wait(30)
        deadline = time.time() + 20
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "workers outlived their launcher"
    finally:
        launcher.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, 9)
