"""Processes that never outlive the process that started them (Linux's parent-death signal).

A training worker outliving its launcher (``kill -9`` of ``train.py``) would go on training and
saving into a job dir whose claim (``recipes.run.launch.claim_job_dir``) names a dead process, so a
second run could start there beside it; an async-save writer outliving its rank would finish a
save nobody finalizes.

Also the scheduling of such a child: :func:`leave_parent_autogroup` moves it out of its
parent's scheduling group, niced, and still dying with its parent.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import time


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel kill this process (SIGKILL) when its parent ends
    (``prctl(PR_SET_PDEATHSIG)``; the parent is the thread that forked this process).

    Args:
        parent_pid: the pid this process's parent had at the fork; if ``os.getppid()`` differs
            once the signal is armed, the parent already died and this process exits at once
            (status 1), since the kernel sends the signal only for a death after arming.

    Returns:
        Whether the signal is armed (False where ``prctl`` is missing: not Linux).
    """
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) == 0
    except (OSError, AttributeError):
        armed = False
    if armed and os.getppid() != parent_pid:
        os._exit(1)
    return armed


def leave_parent_autogroup(parent_pid: int, nice: int) -> bool:
    """Move this forked child out of its parent's scheduling group, to one of its own at
    ``nice``, armed to be killed when the parent dies.

    With the kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``; they apply to
    tasks in the root CPU cgroup) each session shares the cores as one unit, and torch's elastic
    launcher starts every rank in a session of its own: a child forked into its rank's session
    is niced only against that rank and, while the rank waits, takes the rank's whole share
    against the other ranks. ``setsid`` gives the child a session, hence an autogroup, of its
    own, niced through ``/proc/self/autogroup`` (:func:`set_autogroup_nice`). Outside the
    parent's process group the launcher's ``killpg`` no longer reaches the child, so the
    kernel's death signal (:func:`die_with_parent`) is armed first, and without it the child
    stays in the parent's session; it exits at once if the parent already died. In a CPU cgroup
    the new session changes nothing and a per-process nice does the work.

    Returns:
        Whether the child now runs in a session of its own.
    """
    if not die_with_parent(parent_pid):  # exits at once if the parent already died
        return False
    try:
        os.setsid()
    except OSError:
        return False  # a process-group leader cannot start a session
    set_autogroup_nice(nice)
    return True


def set_autogroup_nice(nice: int, path: str = "/proc/self/autogroup", attempts: int = 30) -> bool:
    """Set the nice value of this process's autogroup (raising it needs no privilege).

    Without CAP_SYS_ADMIN the kernel accepts one autogroup nice change per 100 ms on the whole
    machine and answers EAGAIN to the others, and sibling children may start at the same moment:
    each retries after 0.10-0.15 s (jittered) until its value is read back.

    Returns:
        Whether ``path`` reads back ``nice`` (False where there are no autogroups).
    """
    for _ in range(attempts):
        try:
            with open(path, "w") as f:
                f.write(str(nice))
        except BlockingIOError:  # EAGAIN: another autogroup changed its nice in the last 100 ms
            time.sleep(0.1 + 0.05 * random.random())
            continue
        except OSError:
            return False
        try:
            with open(path) as f:
                return f.read().split()[-1] == str(nice)
        except (OSError, IndexError):
            return False
    return False
