"""Processes that never outlive the process that started them (Linux's parent-death signal).

A training worker outliving its launcher (``kill -9`` of ``train.py``) would go on training and
saving into a job dir whose claim (``recipes.launch.claim_job_dir``) names a dead process, so a
second run could start there beside it; an async-save writer outliving its rank would finish a
save nobody finalizes.
"""

from __future__ import annotations

import os
import signal


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
    import ctypes

    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) == 0
    except (OSError, AttributeError):
        armed = False
    if armed and os.getppid() != parent_pid:
        os._exit(1)
    return armed
