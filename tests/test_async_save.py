"""checkpoint.async_save=true: megatron's async torch_dist save, finalized before the tracker."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from multiproc import run_distributed

from ckpt import io as checkpoint
from ckpt.io import lifetime
from recipes.metrics.logger import read_metrics

COMMON = ["train.train_iters=4", "optim.lr_warmup_iters=1", "checkpoint.save_interval=2"]
# Three saves: the third reuses the plan cached by the first two (AsyncSaves.save_options).
THREE_SAVES = ["train.train_iters=6", *COMMON[1:]]


def _tensors(iter_path, tmp) -> dict:
    """Every tensor of a torch_dist checkpoint, read with torch's own converter."""
    tmp.mkdir(exist_ok=True)
    out = tmp / (iter_path.name + ".pt")
    dcp_to_torch_save(iter_path, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def _losses(run_dir) -> dict:
    return {r["iteration"]: r["lm loss"] for r in read_metrics(run_dir)[0]}


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    # Both in one world (tests/helpers/inworld.py): each rank forks its writer as under train.py.
    root = tmp_path_factory.mktemp("async")
    train_jobs([(root / "sync", THREE_SAVES),
                (root / "async", [*THREE_SAVES, "checkpoint.async_save=true"])])
    return root


def test_async_save_writes_what_the_synchronous_save_writes(runs, tmp_path):
    """Training goes on while iteration 2 is written; the files still hold iteration 2's state
    (and 4's and 6's, written with a reused plan)."""
    for run in ("sync", "async"):
        assert checkpoint.read_tracker(runs / run / "checkpoints") == 6
        # Every staged save was renamed into place.
        assert not list((runs / run / "checkpoints").glob(".iter_*")), run
    assert _losses(runs / "sync") == _losses(runs / "async")
    for it in (2, 4, 6):
        want = _tensors(checkpoint.iter_dir(runs / "sync" / "checkpoints", it), tmp_path / "s")
        got = _tensors(checkpoint.iter_dir(runs / "async" / "checkpoints", it), tmp_path / "a")
        assert sorted(got) == sorted(want) and len(want) > 10
        for key in want:
            assert torch.equal(got[key], want[key]), (it, key)


@pytest.mark.parametrize("killed", [1, 0])  # 0: megatron's coordinator of the finalize
def test_writer_killed_during_async_save_keeps_the_previous_checkpoint(train_run, tmp_path,
                                                                       killed):
    fault = f"kill:async_write:4:{killed}"
    proc = train_run(tmp_path, *COMMON, "checkpoint.async_save=true", rc=1,
                     env={"GTP_RECIPES_FAULT": fault})
    assert f"injected fault {fault}" in proc.stdout
    summary = proc.stdout[proc.stdout.index("\nerror: worker rank"):]
    # The job's closing summary gives the cause on every rank, not only "worker rank N failed".
    # (A rank may be stopped by the launcher, exit code -15, once the other has failed.)
    blocks = re.findall(r"\n(?:error|then): worker rank \d failed \(exit code -?\d+\):\n(.*)",
                        summary)
    assert blocks and summary.startswith("\nerror: worker rank"), summary[:2000]
    for block in blocks:
        assert re.match(rf"CheckpointError: the background save of iteration 4 into \S+ failed "
                        rf"on rank\(s\) \[{killed}\]: rank {killed}: its writer (ended without "
                        rf"reporting a result|exited with code -9 \(signal 9\))\. Nothing was "
                        rf"renamed into place.*latest_checkpointed_iteration.txt still names "
                        rf"iteration 2$", block), block
    root = tmp_path / "checkpoints"
    assert checkpoint.read_tracker(root) == 2, "the tracker must still name the last complete save"
    # Nothing of the failed save was renamed into place: only the hidden staging dir is left.
    assert not checkpoint.iter_dir(root, 4).exists()
    assert not (checkpoint.staging_dir(root, 4) / ".metadata").exists()
    assert checkpoint.iter_dir(root, 2).is_dir()


def _state(rank: int, world: int, value: float, split: bool = False, extra: bool = False) -> dict:
    """Rows ``4*rank:4*rank+4`` of a (4*world, 3) tensor "w", through a factory that writes them
    as one piece, or (``split``) as two: the same factory key, shape and dtype either way."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def build(key, data, replica_id, flattened_range):
        # Irregular pieces (explicit global offsets) on every rank, as ckpt/format/logical_format.py's.
        rows = ((0, 2), (2, 4)) if split else ((0, 4),)
        return [ShardedTensor(key, data[lo:hi].clone(), data.dtype, (hi - lo, 3), (4 * world, 3),
                              (4 * rank + lo, 0), None, replica_id=replica_id)
                for lo, hi in rows]

    state = {"w": ShardedTensorFactory("w", torch.full((4, 3), value + rank), build,
                                       lambda pieces: torch.cat(pieces), 0, None)}
    if extra:  # a tensor only this rank holds: a valid structure that differs on this rank
        state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.full((2,), value))
    return state


def _loadable(rank: int, world: int, extra: bool) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), -1.0), (0, rank, world))}
    if extra:
        state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.full((2,), -1.0))
    return state


# Per async save: whether rank 1 writes its rows of "w" as two pieces (a change inside the
# factory only), and whether it holds the extra tensor.
PLAN = [(False, False)] * 5 + [(True, False)] * 3 + [(True, True)]


def _saves_with_cached_plans(root: str) -> list:
    """Async saves with new data each time and the structure of :data:`PLAN`; what each save
    was told, whether its plan was reused, what it wrote."""
    from megatron.core import dist_checkpointing

    from mcore_compat import cpu as cpu_compat

    cpu_compat.install()  # as a training process: megatron's writer syncs "CUDA" before forking
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    from ckpt.io import async_save

    async_save.use_in_process_results_queue(True)
    saves = checkpoint.AsyncSaves()
    seen = []
    for n, (split, extra) in enumerate(PLAN):
        split, extra = split and rank == 1, extra and rank == 1
        state = _state(rank, world, 10.0 * n, split, extra)
        where = f"{root}/save{n}"
        if rank == 0:
            os.makedirs(where)
        torch.distributed.barrier()
        options = saves.save_options(state)
        reused = bool(options["sharded_strategy"].validated_cache_reuse)
        request = dist_checkpointing.save(state, where, async_sharded_save=True,
                                          async_strategy="mcore", **options)
        saves.agree_on_plan_reuse()
        saves.schedule(request)
        saves.wait()
        loaded = dist_checkpointing.load(_loadable(rank, world, extra), where)
        seen.append((options["validate_access_integrity"], reused, dict(loaded)))
    return seen


def test_async_saves_reuse_their_plan_only_while_the_structure_is_the_same(tmp_path):
    """A save whose structure every rank saved and validated before skips megatron's validation;
    megatron reuses its cached plan from the third save of a structure on; every save still
    writes its own data. A change on one rank only, inside a factory (same key, shape, dtype)
    or by an extra tensor, makes every rank validate and plan again (none hangs)."""
    world = 2
    for rank, seen in enumerate(run_distributed(_saves_with_cached_plans, world, str(tmp_path))):
        assert [v for v, _, _ in seen] == [True, False, False, False, False,
                                           True, False, False, True]
        assert [r for _, r, _ in seen] == [False, False, True, True, True,
                                           False, False, True, False]
        for n, (_, _, loaded) in enumerate(seen):
            assert torch.equal(loaded["w"], torch.full((4, 3), 10.0 * n + rank)), (rank, n)
        assert ("extra" in seen[-1][2]) == (rank == 1)
        if rank == 1:
            assert torch.equal(seen[-1][2]["extra"], torch.full((2,), 10.0 * (len(PLAN) - 1)))


# A stand-in for a training rank: schedules an async save through AsyncSaves.schedule, whose
# queue (megatron's, stubbed here) forks the writer; the writer reports what it sees before any
# code of its own runs, then both sleep until killed.
_RANK_AND_WRITER = r"""
import json, os, sys, time
from ckpt.io import AsyncSaves

report = sys.argv[1]
rank_pid = os.getpid()

def autogroup(pid):
    try:
        return open(f"/proc/{pid}/autogroup").read().split()
    except OSError:
        return None

class ForkingQueue:  # megatron's AsyncCallsQueue forks its writer in schedule_async_request
    def get_num_unfinalized_calls(self):
        return 0
    def schedule_async_request(self, request):
        if os.fork() == 0:
            info = {"pid": os.getpid(), "sid": os.getsid(0), "rank_sid": os.getsid(rank_pid),
                    "autogroup": autogroup(os.getpid()), "rank_autogroup": autogroup(rank_pid)}
            with open(report + ".tmp", "w") as f:
                json.dump(info, f)
            os.rename(report + ".tmp", report)
            time.sleep(120)
            os._exit(0)

saves = AsyncSaves.__new__(AsyncSaves)
saves._queue = ForkingQueue()
saves.schedule(None)
if os.fork() == 0:  # any other fork of the rank stays in the rank's session
    with open(report + ".other", "w") as f:
        f.write(str(os.getsid(0)))
    os._exit(0)
os.wait()
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    """The process no longer runs (it never existed, was reaped, or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_async_writer_runs_in_a_scheduling_group_of_its_own_and_dies_with_its_rank(tmp_path):
    """The writer forked in AsyncSaves.schedule leaves its rank's session as soon as it exists,
    so the kernel's autogroups (one per session; torch's launcher starts each rank in its own)
    no longer give it the rank's share of the cores: its own autogroup runs at WRITER_NICE.
    Other forks of the rank stay in its session. Out of the rank's process group, the writer
    still dies when the rank is killed."""
    import json
    import signal
    import subprocess
    import sys
    import time

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report, info = tmp_path / "writer.json", {}
    rank = subprocess.Popen([sys.executable, "-c", _RANK_AND_WRITER, str(report)], cwd=repo,
                            env={**os.environ, "PYTHONPATH": repo}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not report.exists():
            assert rank.poll() is None and time.monotonic() < deadline, "no writer report"
            time.sleep(0.05)
        info = json.loads(report.read_text())
        assert info["sid"] == info["pid"] != info["rank_sid"] == rank.pid, info
        while not (tmp_path / "writer.json.other").exists():
            assert rank.poll() is None and time.monotonic() < deadline, "no report of a fork"
            time.sleep(0.05)
        assert (tmp_path / "writer.json.other").read_text() == str(rank.pid)
        if info["rank_autogroup"] is not None:  # kernels built with autogroups
            assert info["autogroup"][0] != info["rank_autogroup"][0], info
            assert info["autogroup"][1:] == ["nice", str(checkpoint.WRITER_NICE)], info
        assert not _gone(info["pid"]), info
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(info["pid"]), "the writer outlived its rank"
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
        if info and not _gone(info["pid"]):  # a writer that outlived its rank
            os.kill(info["pid"], signal.SIGKILL)


# One training process (a gloo world of 1) with a save in flight whose writer (megatron's own
# fork, through AsyncSaves.schedule) takes a minute; then Ctrl-C.
_INTERRUPTED_WHILE_WRITING = r"""
import os, signal, sys, time
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from mcore_compat import cpu as cpu_compat
from ckpt.io import AsyncSaves

def slow_write(report):
    with open(report, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)

# Ctrl-C raises KeyboardInterrupt as in a terminal, also when this test runs in the background
# of a shell without job control (which starts it with SIGINT ignored: Python then installs no
# handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)
cpu_compat.install()
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0,
                                     world_size=1)
saves = AsyncSaves()
saves.schedule(AsyncRequest(slow_write, (sys.argv[1],), []))
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(60)
"""


def test_a_process_interrupted_during_an_async_write_kills_its_writer(tmp_path):
    """Ctrl-C (SIGINT, which torch's launcher forwards to each rank's process group: no longer
    the writer's) while an async save is being written: the process ends at once and its writer
    with it, instead of joining the writer at exit (AsyncSaves.abort at exit)."""
    import subprocess
    import sys
    import time

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = tmp_path / "writer.pid"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_WHILE_WRITING, str(report),
                           str(tmp_path / "init")], cwd=repo,
                          env={**os.environ, "PYTHONPATH": repo}, capture_output=True,
                          text=True, timeout=120)
    ended = time.monotonic() - t0
    assert "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    writer = int(report.read_text())
    deadline = time.monotonic() + 10
    while not _gone(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(writer), "the writer outlived the interrupted process"
    assert ended < 45, f"the process took {ended:.0f} s to end (it joined its writer)"


def test_autogroup_nice_is_retried_while_the_kernel_answers_eagain(monkeypatch):
    """Without CAP_SYS_ADMIN the kernel takes one autogroup nice change per 100 ms on the
    machine (EAGAIN for the others), and every rank's writer asks at once: the writer retries
    until its value reads back; any other error, or another value read back, gives up."""
    import io
    import time

    monkeypatch.setattr(time, "sleep", lambda s: None)
    state = {"eagain": 2, "writes": 0, "nice": "0", "error": None}

    class Autogroup(io.StringIO):
        def __init__(self, mode):
            super().__init__("" if "w" in mode else f"/autogroup-7 nice {state['nice']}\n")
            self.mode_ = mode

        def close(self):
            if "w" in self.mode_ and not getattr(self, "written", False):
                self.written = True  # once, whether the write raises or not
                state["writes"] += 1
                if state["error"] is not None:
                    raise state["error"]
                if state["eagain"]:
                    state["eagain"] -= 1
                    raise BlockingIOError(11, "Resource temporarily unavailable")
                state["nice"] = self.getvalue()
            super().close()

    monkeypatch.setattr(lifetime, "open", lambda path, mode="r": Autogroup(mode), raising=False)
    assert lifetime.set_autogroup_nice(10) is True
    assert state == {"eagain": 0, "writes": 3, "nice": "10", "error": None}
    state.update(eagain=100, writes=0)
    assert lifetime.set_autogroup_nice(10, attempts=5) is False and state["writes"] == 5
    state.update(eagain=0, writes=0, error=PermissionError(1, "Operation not permitted"))
    assert lifetime.set_autogroup_nice(12) is False and state["writes"] == 1
    state.update(error=None, nice="3")
    monkeypatch.setattr(lifetime, "open", lambda path, mode="r": Autogroup(mode)
                        if "r" in mode else io.StringIO(), raising=False)
    assert lifetime.set_autogroup_nice(10) is False  # the value did not take
