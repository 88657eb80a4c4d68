"""Refusals: bad input a process stops on with one message, no traceback, exit code 2.

A refusal is a :class:`recipes.config.validate.ConfigError`, a
:class:`ckpt.io.errors.CheckpointError` (a :class:`ckpt.io.lease.LeaseHeld` too), or
:mod:`ckpt.format.safe_objects`' refusal of a crafted checkpoint (itself, a cause, or one rank's error of
torch DCP's ``CheckpointException``). Before launch ``train.py`` prints it as ``error: ...``; in a
worker started by ``train.py`` it goes to torch elastic's error file (:func:`record`) and the
launcher prints it once (``recipes.run.launch.launch_local``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from ckpt.io.errors import CheckpointError
from recipes.config.errors import ConfigError

EXIT_CODE = 2
# The key of a refusal in torch elastic's error file (extraInfo): the launcher prints it as is.
MARK = "refusal"


def message(exc: BaseException) -> str | None:
    """The message of the refusal behind ``exc``, or None when ``exc`` is another error."""
    if isinstance(exc, (ConfigError, CheckpointError)):
        return str(exc)
    if "ckpt.format.safe_objects" in sys.modules:  # loaded by whatever read a checkpoint
        refused = sys.modules["ckpt.format.safe_objects"].refusal(exc)
        if refused is not None:
            return f"{type(refused).__name__}: {refused}"
    return None


def record(text: str, launched_by_train_py: bool) -> None:
    """Report a worker's refusal: into torch elastic's error file (``TORCHELASTIC_ERROR_FILE``),
    which ``train.py``'s launcher prints once; printed here as ``error: ...`` when no such
    launcher will (a worker started by torchrun itself, or with no error file)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": text,
                            "extraInfo": {MARK: True, "timestamp": str(int(time.time()))}}}
        with open(path, "w") as f:
            json.dump(data, f)
    if not (path and launched_by_train_py):
        print(f"error: {text}", file=sys.stderr, flush=True)


def is_refusal(failure) -> bool:
    """Whether a torch elastic ``ProcessFailure`` is a worker's refusal (:func:`record`)."""
    data = failure.error_file_data
    info = data.get("message", {}) if isinstance(data, dict) else {}
    return isinstance(info, dict) and bool((info.get("extraInfo") or {}).get(MARK))
