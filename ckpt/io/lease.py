"""One live run per dir: a lease file naming its holder, taken atomically, kept alive by a
heartbeat, given back at exit.

Two uses: the job dir's claim (``<output_dir>/.job_claim``, :func:`recipes.run.launch.claim_job_dir`)
and the save dir's writer lease (``<checkpoint.save>/.writer_lease``, :func:`take_save_dir`),
re-checked before every save is renamed into place (:func:`check_writer`).

A lease holds the run id, the scheduler's job id (:func:`ckpt.io.job.job_id`), the host, the
pid, the pid's process start time and, as the file's modification time, the heartbeat. On this
host the process decides: a holder whose pid is alive with the start time recorded holds the
lease whatever its heartbeat; one whose process is gone, is this process (a lease it no longer
holds) or is another process under a reused pid (its start time differs: also a restarted
container's new pid 1) is stale, taken over with a note; a lease without a start time (older
files) is also stale when its pid is an ancestor of this process. Otherwise (another host, or an
older lease of a live pid) the heartbeat decides, judged by change, never against this host's
clock (the holder's host or the file server may keep another time): :meth:`Lease.take` watches
the file for :data:`STALE_AFTER_S` and takes it over only when its modification time did not
move. A live holder is refused, naming it and the file (two runs in one allocation share a job
id: the second is refused).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from ckpt.io.errors import CheckpointError
from ckpt.io.job import job_id as scheduler_job_id

WRITER_LEASE = ".writer_lease"
# Set for the workers (and by rank 0 under torchrun/Slurm): the run id holding the writer lease.
RUN_ID_ENV = "GTP_RECIPES_RUN_ID"
HEARTBEAT_S = 10.0
# A lease whose heartbeat did not move while watched this long is stale (several missed beats).
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
    ``start``: :func:`process_start` of the pid, ``heartbeat``: the file's modification time, as
    the file system records it; ``file``: ``path``), or None when there is none. A file of the
    older ``HOST PID`` form reads as such a holder without ids."""
    path = Path(path)
    try:
        text, beat = path.read_text(), path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        host, pid = (text.split() + ["", "0"])[:2]
        holder = {"host": host, "pid": int(pid) if pid.isdigit() and len(pid) < 9 else 0}
    if not isinstance(holder, dict):
        holder = {}
    holder = _plain(holder)
    holder["heartbeat"], holder["file"] = beat, str(path)
    return holder


# Linux's largest pid (pid_max's ceiling): a recorded pid beyond it names no process.
PID_MAX = 1 << 22


def _plain(holder: dict) -> dict:
    """``holder``'s fields of the expected types: text ids, a pid in ``1..PID_MAX``, a numeric
    start time; anything else (a damaged or hand-edited file) reads as absent (pid 0: no
    process, so a lease of this host is stale), never as an error."""
    out = {k: v for k, v in holder.items() if k in ("run_id", "job_id", "host")
           and isinstance(v, str)}
    pid = holder.get("pid")
    out["pid"] = pid if isinstance(pid, int) and not isinstance(pid, bool) and (
        0 < pid <= PID_MAX) else 0
    start = holder.get("start")
    if isinstance(start, (int, float)) and not isinstance(start, bool):
        out["start"] = start
    return out


def describe(holder: dict) -> str:
    """``run R (job J), process P on HOST, last heartbeat at T (file time)``: the heartbeat as the
    file records it, not an age against this host's clock, which may differ."""
    job = f" (job {holder['job_id']})" if holder.get("job_id") else ""
    run = f"run {holder['run_id']}" if holder.get("run_id") else "a run"
    beat = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("heartbeat", 0)))
    return (f"{run}{job}, process {holder.get('pid', '?')} on {holder.get('host') or '?'}, "
            f"last heartbeat at {beat} (file time)")


def _same_holder(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and all(
        a.get(k) == b.get(k) for k in ("run_id", "pid", "host", "job_id"))


def watch(path, holder: dict, seconds: float) -> str | None:
    """Watch the lease file ``path`` that named ``holder`` for up to ``seconds`` (this host's
    monotonic clock: elapsed time only). Returns why ``holder`` no longer holds it: its heartbeat
    did not move the whole time, or the file is gone or names another holder; None as soon as
    its heartbeat moves (live)."""
    poll = max(0.05, min(1.0, seconds / 20))
    end = time.monotonic() + seconds
    while True:
        now = read(path)
        if not _same_holder(now, holder):
            return "its lease file was removed or taken by another run while watched"
        if now["heartbeat"] != holder.get("heartbeat"):
            return None
        if time.monotonic() >= end:
            return f"its heartbeat did not move in {seconds:.0f} s watched"
        time.sleep(min(poll, max(0.0, end - time.monotonic())))


def stale_reason(holder: dict, job_id: str | None, watch_s: float | None = None) -> str | None:
    """Why ``holder`` (:func:`read`) no longer holds its lease (None: it is live). On this host
    its process decides: gone, this process (but for a lease it still holds), another process
    under a reused pid (the start time recorded differs: also a restarted container's new pid 1)
    or, for a lease that records no start time, an ancestor of this process: stale; alive with
    its recorded start time: live, whatever its heartbeat. Otherwise the heartbeat decides: with
    ``watch_s`` the file is watched that long (:func:`watch`), a heartbeat that does not move is
    stale; without, such a holder counts as live. ``job_id``: this job's (the same job before a
    requeue is judged alike)."""
    if holder.get("host") == socket.gethostname():
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
    if watch_s is None or "file" not in holder:
        return None
    return watch(holder["file"], holder, watch_s)


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
        """Create the lease file exclusively; a stale one (:func:`stale_reason`: on this host by
        its process; else, with ``wait``, by watching its heartbeat for :data:`STALE_AFTER_S`)
        is moved away first: a rename, after which the file moved is read again, and put back
        when it is no longer the stale holder judged (another taker's fresh lease).

        Args:
            what: the dir's role for messages, e.g. ``"checkpoint.save"``.
            wait: watch a holder that its process cannot judge (another host's) for a heartbeat
                (False: it is live).

        Returns:
            A note naming the stale holder taken over, or None.

        Raises:
            LeaseHeld: a live holder, named with the file to remove should it be wrong.
        """
        note = None
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
                why = stale_reason(holder, self.job_id, STALE_AFTER_S if wait else None)
                if why is None:
                    raise LeaseHeld(
                        f"{what} {self.path.parent} is in use by {describe(holder)}; wait for it "
                        f"to end, use another dir, or, if that run is gone, remove {self.path}")
                if why.startswith("its lease file was removed"):
                    continue  # it changed hands while watched: judge the new holder
                aside = self.path.with_name(f"{self.path.name}.stale.{self.run_id}")
                try:
                    os.replace(self.path, aside)
                except FileNotFoundError:
                    continue  # another taker moved it first
                moved = read(aside)
                if not _same_holder(moved, holder):
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

    def held(self) -> bool:
        """Whether the lease file still names this run (False where it cannot be read)."""
        try:
            holder = read(self.path)
        except OSError:
            return False
        return holder is not None and holder.get("run_id") == self.run_id

    def _beat(self) -> None:
        """Renew the heartbeat every :data:`HEARTBEAT_S` while the file names this run. A beat
        that fails (``EROFS``, ``EIO``, ``ESTALE``: a file system read-only or unreachable for a
        while) is retried at the next beat, said once when the failures start and once when a
        beat gets through again; a live holder on this host holds the lease meanwhile (its
        process decides), a holder on another host is taken over only after
        :data:`STALE_AFTER_S` without a beat."""
        failing = None
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder = read(self.path)
                if holder is not None and holder.get("run_id") != self.run_id:
                    return  # another run took it over: never beat its lease
                if holder is None:
                    return  # removed (released, or a stale takeover in progress)
                os.utime(self.path)
            except OSError as exc:
                if failing is None:
                    failing = time.monotonic()
                    print(f"> warning: the heartbeat of {self.path} failed ({exc}); retrying "
                          f"every {HEARTBEAT_S:.0f} s", file=sys.stderr, flush=True)
                continue
            if failing is not None:
                print(f"> note: the heartbeat of {self.path} is renewed again after "
                      f"{time.monotonic() - failing:.0f} s of failures", file=sys.stderr,
                      flush=True)
                failing = None

    def release(self) -> None:
        """Remove the lease file if it still names this run; never raises (also at exit, from
        its ``atexit`` callback): a file system that is read-only or gone leaves the file,
        which the next taker judges stale (its process is gone)."""
        self._stop.set()
        _HELD_HERE.discard(self.run_id)
        try:
            if self.held():
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


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
