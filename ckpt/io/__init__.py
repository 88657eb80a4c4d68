"""Save and load Megatron ``torch_dist`` checkpoints that reshard across TP, PP, DP and GTP layouts
and between megatron's plain and distributed optimizer.

What one checkpoint holds: ``model`` and ``optimizer`` (Adam moments, fp32 main params and
``step``, sharded like their params), the lr scheduler, ``iteration``, the training state
(consumed samples, wandb run id), the resolved run config, the layout it was saved at and each
rank's RNG state (:mod:`ckpt.io.state`). ``docs/checkpointing.md`` describes the
lifecycle a run goes through (:class:`~ckpt.io.manager.CheckpointManager`).

Modules, one concern each:

* :mod:`~ckpt.io.errors` - :class:`CheckpointError` and torch DCP's per-rank errors;
* :mod:`~ckpt.io.files` - names, the tracker, durable writes, disk space, retention;
* :mod:`~ckpt.io.integrity` - is a checkpoint loadable (before any tensor is read);
* :mod:`~ckpt.io.state` - the sharded state dicts, RNG state and layout record;
* :mod:`~ckpt.io.async_save` - saves written in the background;
* :mod:`~ckpt.io.save` - one save, staged then renamed into place;
* :mod:`~ckpt.io.load` - a resume, or the model weights alone;
* :mod:`~ckpt.io.manager` - the run's checkpoint lifecycle.

The names below are the package's API. The modules that import megatron are loaded on first
use of one of their names (start-up time: ``train.py`` imports this package before launch).
"""

from __future__ import annotations

from ckpt.format.records import TRACKER
from ckpt.io.errors import CheckpointError
from ckpt.io.files import (
    ITER_NAME,
    ensure_disk_space,
    fsync_dir,
    iter_dir,
    read_tracker,
    recover_replaced,
    remove_old_checkpoints,
    save_files,
    saved_iterations,
    staging_dir,
    tracked,
    write_durable,
)
from mcore_compat.lazy import lazy_names

_LAZY = {
    "integrity": ("check_loadable", "check_shapes", "stored_shapes", "verify_before_load"),
    "state": ("layout_record", "optimizer_metadata"),
    "async_save": ("AsyncSaves", "WRITER_NICE", "structure_fingerprint"),
    "save": ("expected_checkpoint_bytes", "finalize_save", "save_checkpoint", "stage_save"),
    "load": ("load_checkpoint", "load_common", "load_model_weights"),
    "manager": ("CheckpointManager", "ResumePlan"),
}

__all__ = ["TRACKER", "CheckpointError", "ITER_NAME", "ensure_disk_space", "fsync_dir", "iter_dir",
           "read_tracker", "recover_replaced", "remove_old_checkpoints", "save_files",
           "saved_iterations",
           "staging_dir", "tracked", "write_durable",
           *(name for names in _LAZY.values() for name in names)]

__getattr__ = lazy_names(__name__, _LAZY)
