"""Fault injection for reliability tests, enabled only by an environment variable.

``GTP_RECIPES_FAULT=ACTION:POINT:ITERATION:RANK`` makes global rank RANK, at POINT of
ITERATION, either ``kill`` itself with SIGKILL (a crashed node: no cleanup, no error file) or
``raise`` a RuntimeError (a bug). POINTs:

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
import functools
import os
import signal
import time

from megatron.core.dist_checkpointing.strategies import filesystem_async

from mcore_compat.patches import megatron_patch

ENV = "GTP_RECIPES_FAULT"
ACTIONS = ("kill", "raise")
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


def maybe_fail(point: str, iteration: int, rank: int) -> None:
    """Fail here if ``GTP_RECIPES_FAULT`` names this point, iteration and rank."""
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
        maybe_fail("write", iteration, rank)
        return result

    filesystem_async._write_item = write_item
    try:
        yield
    finally:
        filesystem_async._write_item = original
