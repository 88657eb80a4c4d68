"""A command line that works the first time and after every requeue: ``checkpoint.load=auto``.

``checkpoint.load=auto`` loads the newest save of ``checkpoint.save`` of the run that wrote its
tracker (its lineage) that loads and verifies, if there is one (and puts its tracker back in
step with it), else starts from scratch. It is the default under
``hydra/launcher=slurm`` and ``submitit_local`` (:func:`default_load`), whose jobs submitit
requeues with the same command after a preemption or a time limit.
"""

from __future__ import annotations

from pathlib import Path

from ckpt import io as checkpoint
from ckpt.io import TRACKER, CheckpointError
from recipes.config.errors import ConfigError

AUTO = "auto"


def default_load():
    """``checkpoint.load``'s default (the ``recipes_default_load`` resolver of
    conf/checkpoint/default.yaml): ``"auto"`` when Hydra's launcher is a submitit one (its jobs
    may be requeued), else None (start from scratch)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    return AUTO if "submitit" in target else None


def resolve_auto_load(cfg, is_rank0: bool = True) -> str | None:
    """With ``checkpoint.load=auto``: set ``checkpoint.load`` (in place) to ``checkpoint.save``
    and ``checkpoint.load_iteration`` to the save that
    :meth:`ckpt.io.manager.ResumePlan.auto` chooses (the newest of the tracker's
    lineage that loads and verifies), or ``checkpoint.load`` to null when it holds no complete
    save. A tracker that names another iteration (a crash between the rename and the tracker's
    write, a damaged save skipped) is rewritten to name it, by global rank 0.

    Returns:
        A note to print (what was found), or None when ``checkpoint.load`` is not ``auto``.

    Raises:
        ConfigError: ``auto`` without ``checkpoint.save``, or with ``checkpoint.load_iteration``.
        CheckpointError: as :meth:`~ckpt.io.manager.ResumePlan.auto`.
    """
    from omegaconf import open_dict

    ck = cfg.checkpoint
    if ck.load != AUTO:
        return None
    if not ck.save:
        raise ConfigError("checkpoint.load=auto loads the newest save of checkpoint.save, which is "
                          "null: set checkpoint.save=DIR, or checkpoint.load=PATH")
    if ck.get("load_iteration") is not None:
        raise ConfigError(f"checkpoint.load=auto loads the newest complete save; with "
                          f"checkpoint.load_iteration={ck.load_iteration} set "
                          f"checkpoint.load={str(ck.save)!r} instead")
    root = Path(ck.save)
    if root.is_dir() and is_rank0:
        checkpoint.recover_replaced(root)
    newest, notes = None, []
    try:
        tracked = checkpoint.read_tracker(root)
    except CheckpointError:
        tracked = None
    if root.is_dir() and checkpoint.saved_iterations(root):
        from ckpt.io.manager import ResumePlan  # megatron: only where there is a save

        # Global rank 0 puts the tracker in step with the save chosen.
        newest, notes = ResumePlan.auto(root, verify=ck.get("verify_on_load", True),
                                        repair=is_rank0)
    with open_dict(cfg):
        if newest is None:
            ck.load = None
            return f"> checkpoint.load=auto: no complete save in {root}; starting from iteration 0"
        ck.load, ck.load_iteration = str(root), newest
    note = f"> checkpoint.load=auto: resuming from {checkpoint.iter_dir(root, newest)}"
    if tracked != newest:
        note += (f" ({TRACKER} named {tracked if tracked is not None else 'nothing'}; "
                 f"rewritten to {newest})")
    return "\n".join([*notes, note])
