"""Fault injection for reliability tests, enabled only by an environment variable.

``GTP_RECIPES_FAULT=ACTION:POINT:ITERATION:RANK`` makes global rank RANK, at POINT of
ITERATION:

- ``kill``: SIGKILL itself (a crashed node: no cleanup, no error file);
- ``raise``: raise a RuntimeError (a bug);
- ``fsize``: lower its own file-size limit (``RLIMIT_FSIZE``, as ``ulimit -f``) to
  :data:`FSIZE_SLACK` bytes past the size of the file it is writing (at ``write``; past 0
  elsewhere), so that the kernel itself fails the write that grows that file past it (SIGXFSZ,
  ignored by Python, then ``EFBIG``); smaller files (logs, torch's error file) still fit;
- ``enospc`` / ``erofs``: raise the ``OSError`` the kernel raises for a write to a full disk /
  a file system remounted read-only (an emulation: a test cannot fill a disk or remount one,
  and root writes through ``chmod``).

POINTs:

- ``train``: after the optimizer step of ITERATION;
- ``write``: in the save of ITERATION, while this rank writes its checkpoint files: after the
  first tensor went into a data file (the file is open and partly written);
- ``save``: in the save of ITERATION, after this rank wrote its checkpoint files and before
  the save is complete on every rank (nothing is renamed into place yet);
- ``async_write``: in the background writer process of an asynchronous save of ITERATION
  (``checkpoint.async_save=true``), before it writes its files: ``kill`` kills the writer, not
  the training process, which learns of it when it finalizes the save.

Unset (the default), :func:`maybe_fail` does nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import resource
import signal
import time

from megatron.core.dist_checkpointing.strategies import filesystem_async

from mcore_compat.patches import megatron_patch

ENV = "GTP_RECIPES_FAULT"
ACTIONS = ("kill", "raise", "fsize", "enospc", "erofs")
FSIZE_SLACK = 64 << 10
ERRNOS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}
POINTS = ("train", "write", "save", "async_write")


def parse(spec: str) -> tuple[str, str, int, int]:
    """Parse ``ACTION:POINT:ITERATION:RANK``.

    Raises:
        ValueError: naming the bad spec and the valid form.
    """
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] not in ACTIONS or parts[1] not in POINTS \
            or not parts[2].isdigit() or not parts[3].isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected ACTION:POINT:ITERATION:RANK with ACTION in "
                         f"{ACTIONS}, POINT in {POINTS}, e.g. 'kill:save:4:1'")
    return parts[0], parts[1], int(parts[2]), int(parts[3])


def maybe_fail(point: str, iteration: int, rank: int, size: int = 0) -> None:
    """Fail here if ``GTP_RECIPES_FAULT`` names this point, iteration and rank (``size``: the
    bytes of the file being written, the limit ``fsize`` sets)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, where, at, who = parse(spec)
    if (where, at, who) != (point, iteration, rank):
        return
    # The wall-clock time of the fault, so tests can bound how fast the job ends after it.
    print(f"> injected fault {spec} at unix time {time.time():.3f}", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (size + FSIZE_SLACK, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return
    if action in ERRNOS:
        code = ERRNOS[action]
        raise OSError(code, f"{os.strerror(code)} (injected fault {ENV}={spec})")
    raise RuntimeError(f"injected fault ({ENV}={spec}) on rank {rank} at {point} of iteration {iteration}")


@contextlib.contextmanager
@megatron_patch("dist_checkpointing.strategies.filesystem_async._write_item (while a write "
                "fault is armed)")
def while_writing(iteration: int, rank: int):
    """While active, the ``write`` fault of ``iteration`` fires inside megatron's file writer,
    right after one item went into an open data file (a rank dying mid-write)."""
    spec = os.environ.get(ENV)
    if not spec or parse(spec)[1:] != ("write", iteration, rank):
        yield
        return
    original = filesystem_async._write_item

    @functools.wraps(original)  # megatron inspects its signature
    def write_item(*args, **kwargs):
        result = original(*args, **kwargs)
        args[1].flush()  # _write_item(transforms, stream, data, write_item, storage_key, ...)
        maybe_fail("write", iteration, rank, size=args[1].tell())
        return result

    filesystem_async._write_item = write_item
    try:
        yield
    finally:
        filesystem_async._write_item = original
