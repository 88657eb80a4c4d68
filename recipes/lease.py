"""One live run per dir: a lease file naming its holder, taken atomically, kept alive by a
heartbeat, given back at exit.

Two uses: the job dir's claim (``<output_dir>/.job_claim``, :func:`recipes.launch.claim_job_dir`)
and the save dir's writer lease (``<checkpoint.save>/.writer_lease``, :func:`take_save_dir`),
re-checked before every save is renamed into place (:func:`check_writer`).

A lease holds the run id, the scheduler's job id (:func:`recipes.rank_env.job_id`), the host, the
pid, the pid's process start time and, as the file's modification time, the heartbeat. It is
stale, and taken over with a note, when its heartbeat is older than :data:`STALE_AFTER_S` (any
host), or, on this host, when its process is gone, is this process (a lease it no longer holds),
or is another process under a reused pid (its start time differs: also a restarted container's
new pid 1); a lease without a start time (older files) is also stale when its pid is an
ancestor of this process. A holder of this job's id (a requeued job keeps it) is judged alike:
on this host its process is gone at once; on another host :meth:`Lease.take` waits once until
its heartbeat is stale. Otherwise it is live and the dir is refused, naming the holder and the
file (two runs in one allocation share a job id: the second is refused).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from recipes.checkpoint.errors import CheckpointError
from recipes.rank_env import job_id as scheduler_job_id

WRITER_LEASE = ".writer_lease"
# Set for the workers (and by rank 0 under torchrun/Slurm): the run id holding the writer lease.
RUN_ID_ENV = "GTP_RECIPES_RUN_ID"
HEARTBEAT_S = 10.0
# A lease whose heartbeat is older than this is stale (several missed beats), on any host.
STALE_AFTER_S = 6 * HEARTBEAT_S
# Run ids of the leases this process holds now: its own live holds are not stale.
_HELD_HERE: set = set()


class LeaseHeld(CheckpointError):
    """The dir is held by another live run."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or
    None where it is gone or there is no ``/proc``: with the pid it names one process, never a
    later one that reuses the pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _ancestors() -> set[int]:
    """This process and its ancestors (from ``/proc``: up to the first whose parent is outside
    this pid namespace, e.g. pid 1, or a ``docker exec``'d process's; this process and its
    parent where there is no ``/proc``)."""
    found, pid = {os.getpid()}, os.getppid()
    while pid > 0 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def read(path) -> dict | None:
    """The holder recorded in the lease file ``path`` (``run_id``, ``job_id``, ``host``, ``pid``,
    ``start``: :func:`process_start` of the pid, ``heartbeat``: unix time of the last beat), or None when there is none. A file of the older
    ``HOST PID`` form reads as such a holder without ids."""
    path = Path(path)
    try:
        text, beat = path.read_text(), path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        host, pid = (text.split() + ["", "0"])[:2]
        holder = {"host": host, "pid": int(pid) if pid.isdigit() else 0}
    if not isinstance(holder, dict):
        holder = {}
    holder["heartbeat"] = beat
    return holder


def describe(holder: dict) -> str:
    """``run R (Slurm/submitit job J) pid P on HOST, last heartbeat S s ago``."""
    job = f" (job {holder['job_id']})" if holder.get("job_id") else ""
    run = f"run {holder['run_id']}" if holder.get("run_id") else "a run"
    age = time.time() - holder.get("heartbeat", 0)
    return (f"{run}{job}, process {holder.get('pid', '?')} on {holder.get('host') or '?'}, "
            f"last heartbeat {age:.0f} s ago")


def stale_reason(holder: dict, job_id: str | None, now: float | None = None) -> str | None:
    """Why ``holder`` no longer holds its lease (None: it is live): its heartbeat stopped (any
    host) or, on this host, its process is gone, is this process (but for a lease it still
    holds), is another process under a reused pid (the start time recorded differs: also a
    restarted container's new pid 1) or, for a lease that records no start time, is an ancestor
    of this process. A holder of this job's id (``job_id``: the same job before a requeue) is
    judged alike: a live one holds the dir (two runs in one allocation); one on another host is
    waited for by :meth:`Lease.take` until its heartbeat stops."""
    now = time.time() if now is None else now
    if now - holder.get("heartbeat", 0) > STALE_AFTER_S:
        return f"no heartbeat for over {STALE_AFTER_S:.0f} s"
    if holder.get("host") != socket.gethostname():
        return None
    pid = int(holder.get("pid") or 0)
    if not pid or not _pid_alive(pid):
        return "its process is gone"
    if pid == os.getpid():
        if holder.get("run_id") in _HELD_HERE:
            return None  # a lease this process took and still holds
        return "it is this process, which no longer holds it"
    start, live = holder.get("start"), process_start(pid)
    if start is not None and live is not None:
        if live != start:
            return f"its pid {pid} is now another process (started at another time)"
        return None  # the very process that took it
    if pid in _ancestors():
        return (f"its pid {pid} is an ancestor of this process (the lease records no start "
                f"time; a restarted container counts pids from 1 again)")
    return None


class Lease:
    """This process's hold on ``path`` (a lease file), once :meth:`take` succeeded: beaten every
    :data:`HEARTBEAT_S` by a daemon thread and removed at exit, if still this run's."""

    def __init__(self, path, run_id: str | None = None, job_id: str | None = None):
        self.path = Path(path)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.job_id = job_id if job_id is not None else scheduler_job_id()
        self.me = {"run_id": self.run_id, "job_id": self.job_id, "host": socket.gethostname(),
                   "pid": os.getpid(), "start": process_start(os.getpid())}
        self._stop = threading.Event()

    def take(self, what: str, wait: bool = True) -> str | None:
        """Create the lease file exclusively; a stale one (:func:`stale_reason`) is moved away
        first (a holder of this job's id on another host, the job before a requeue, is waited
        for once until its heartbeat is :data:`STALE_AFTER_S` old): a rename, after which the file moved is read again, and put back when it is no
        longer the stale holder judged (another taker's fresh lease).

        Args:
            what: the dir's role for messages, e.g. ``"checkpoint.save"``.
            wait: wait for a holder of this job's id on another host (False: it is live).

        Returns:
            A note naming the stale holder taken over, or None.

        Raises:
            LeaseHeld: a live holder, named with the file to remove should it be wrong.
        """
        note, waited = None, False
        for _ in range(4):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read(self.path)
                if holder is None:
                    continue
                if holder.get("run_id") == self.run_id:
                    return note  # already ours
                why = stale_reason(holder, self.job_id)
                if why is None and wait and self._requeued_elsewhere(holder) and not waited:
                    waited = True  # this job before a requeue, on another host: its beat stops
                    time.sleep(max(0.0, holder["heartbeat"] + STALE_AFTER_S + 1 - time.time()))
                    continue
                if why is None:
                    raise LeaseHeld(
                        f"{what} {self.path.parent} is in use by {describe(holder)}; wait for it "
                        f"to end, use another dir, or, if that run is gone, remove {self.path}")
                aside = self.path.with_name(f"{self.path.name}.stale.{self.run_id}")
                try:
                    os.replace(self.path, aside)
                except FileNotFoundError:
                    continue  # another taker moved it first
                moved = read(aside)
                if moved is None or moved.get("run_id") != holder.get("run_id") or (
                        moved.get("pid") != holder.get("pid")):
                    # Another taker replaced the stale lease with its own between our read and
                    # the rename: put it back (unless a third one already took the name).
                    try:
                        os.link(aside, self.path)
                    except FileExistsError:
                        pass
                    aside.unlink(missing_ok=True)
                    continue
                aside.unlink(missing_ok=True)
                if self.job_id and holder.get("job_id") == self.job_id:
                    why += f" (this job, {self.job_id}, before a requeue)"
                note = f"> note: took over {what} {self.path.parent} from {describe(holder)}: {why}"
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            _HELD_HERE.add(self.run_id)
            atexit.register(self.release)
            threading.Thread(target=self._beat, name=f"lease-{self.path.name}",
                             daemon=True).start()
            return note
        raise LeaseHeld(f"{what} {self.path.parent}: {self.path} keeps changing hands; another "
                        f"run is starting there")

    def _requeued_elsewhere(self, holder: dict) -> bool:
        """``holder`` names this job's id (a requeue keeps it) and another host."""
        return bool(self.job_id) and holder.get("job_id") == self.job_id and (
            holder.get("host") != socket.gethostname())

    def held(self) -> bool:
        """Whether the lease file still names this run."""
        holder = read(self.path)
        return holder is not None and holder.get("run_id") == self.run_id

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held():
                return
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lease file if it still names this run."""
        self._stop.set()
        _HELD_HERE.discard(self.run_id)
        if self.held():
            self.path.unlink(missing_ok=True)


def take_save_dir(root, run_id: str | None = None) -> tuple[Lease, str | None]:
    """Take ``<root>/.writer_lease`` for this run (``checkpoint.save``) and publish the run id
    to the workers (:data:`RUN_ID_ENV`).

    Returns:
        ``(lease, note)``: the note names a stale holder taken over.

    Raises:
        LeaseHeld: as :meth:`Lease.take`.
    """
    lease = Lease(Path(root) / WRITER_LEASE, run_id=run_id)
    note = lease.take("checkpoint.save")
    os.environ[RUN_ID_ENV] = lease.run_id
    return lease, note


def check_writer(root) -> None:
    """Before a save is renamed into ``root``: the writer lease still names this run (from
    :data:`RUN_ID_ENV`; nothing to check without one).

    Raises:
        LeaseHeld: another run took the dir over; naming it.
    """
    mine = os.environ.get(RUN_ID_ENV)
    if not mine:
        return
    path = Path(root) / WRITER_LEASE
    holder = read(path)
    if holder is not None and holder.get("run_id") == mine:
        return
    who = describe(holder) if holder else "nobody (its lease file is gone)"
    raise LeaseHeld(f"checkpoint.save {root} is now held by {who}, not by this run ({mine}); "
                    f"the save was not renamed into place and nothing of the other run's was "
                    f"replaced")
