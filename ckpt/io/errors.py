"""The checkpoint wing's error, and the unwrapping of torch DCP's per-rank failures into it."""

from __future__ import annotations

import sys
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded exactly; the message names the file or tensor."""


def unreadable(file: Path, exc: BaseException, what: str) -> CheckpointError:
    """The error for a checkpoint file that exists but cannot be read as ``what``."""
    return CheckpointError(
        f"{file} cannot be read ({describe(exc)}): it is torn or not {what}; load another "
        f"iteration (checkpoint.load_iteration=N) or another checkpoint.load")


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for torch DCP's ``CheckpointException``, that of each
    rank's exception (:func:`rank_errors`) instead of the traces."""
    errors = rank_errors(exc)
    if errors:
        return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                         for rank, error in sorted(errors.items()))
    return f"{type(exc).__name__}: {exc}"


def rank_errors(exc: BaseException) -> dict:
    """rank -> exception of torch DCP's ``CheckpointException`` (its ``failures``: rank ->
    (exception, traceback)); empty for any other exception."""
    # Not imported here (start-up time: train.py reaches this module before launch); an
    # exception of that type exists only once torch's module is loaded.
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is None or not isinstance(exc, api.CheckpointException):
        return {}
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in exc.failures.items()}
