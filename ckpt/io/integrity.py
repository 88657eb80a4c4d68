"""Is a checkpoint loadable, before any tensor is read: its tracker and files complete, its
data files as long as its metadata says, every byte as written (``ckpt.verify``), every requested
tensor present with its shape."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ckpt.format import safe_metadata, safe_objects
from ckpt import verify
from gtp.collectives import any_rank_failed
from ckpt.io.errors import CheckpointError, unreadable
from ckpt.io.files import check_root, iter_dir, read_tracker, saved_iterations
from ckpt.adapt.optim_kinds import without_chain_prefix


def check_loadable(root: str | os.PathLike, iteration: int | None = None) -> Path:
    """Cheap pre-launch check that ``root`` holds a complete checkpoint; returns its iter dir.

    Args:
        root: the checkpoint dir.
        iteration: a specific saved iteration; None: the one the tracker names. Any complete
            ``iter_*`` dir loads, also one newer than the tracker (saves are renamed into place
            only when complete) or one of a dir whose tracker is missing or garbled (the
            tracker is read only when ``iteration`` is None).

    Raises:
        CheckpointError: as :func:`ckpt.io.files.read_tracker` (``iteration`` None;
            else as :func:`ckpt.io.files.check_root`), the iteration is
            missing or incomplete, it holds a ``common.pt`` (damage: named), its data files are
            truncated, or its metadata is not what a checkpoint holds.
    """
    if iteration is None:
        iteration = read_tracker(root)
    else:
        check_root(Path(root))
    if not iter_dir(root, iteration).is_dir():
        raise CheckpointError(
            f"checkpoint.load_iteration={iteration}: no complete save of it in {root}; "
            f"complete iterations there: {saved_iterations(root)}"
        )
    path = iter_dir(root, iteration)
    # megatron 0.19.2 keeps the common state in the data files; it would read a common.pt
    # (older versions' layout, never written here) in its place.
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    stray = safe_objects.stray_common_state(path)
    if stray:
        raise CheckpointError(
            f"{path} is damaged: {path / safe_objects.COMMON_STATE_FNAME}: {stray}")
    check_storage(path)
    return path


def check_storage(path: Path) -> None:
    """Every item the checkpoint's metadata lists lies inside its data file.

    Cheap (one stat per file) and done before any tensor is read, so a truncated or missing
    ``.distcp`` file fails the load before it changes anything.

    Raises:
        CheckpointError: naming the file, its size, what should be there and one tensor in it.
    """
    safe_objects.install()  # also no object pickle of the checkpoint runs code
    try:
        metadata = safe_metadata.read_metadata(path)
    except safe_metadata.UnsafeMetadataError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a torn .metadata
        raise unreadable(path / ".metadata", exc, "a torch_dist checkpoint's metadata") from exc
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, fqn) in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            state = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"{file} {state}, but the checkpoint's metadata places data up to byte {end} "
                f"in it (e.g. tensor {fqn!r}): the checkpoint is truncated or incomplete"
            )


# What a refused load of a damaged checkpoint suggests (checkpoint.load).
LOAD_FIX = "load another iteration (checkpoint.load_iteration=N) or another checkpoint.load"


def verify_before_load(path: Path, fix: str = LOAD_FIX) -> None:
    """:func:`ckpt.verify.check_share` on every rank; a problem any rank finds fails the load on
    every rank, each naming the same files and items and ``fix`` (a collective)."""
    problems = verify.check_share(path, torch.distributed.get_rank(),
                                  torch.distributed.get_world_size())
    if any_rank_failed(bool(problems)):
        found: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, problems[:5])
        problems = list(dict.fromkeys(p for mine in found for p in mine))  # .metadata's: all
        raise CheckpointError(
            f"{verify.CheckpointDamaged(path, problems)}: not loaded "
            f"(checkpoint.verify_on_load); {fix}")


def stored_shapes(path) -> dict:
    """``{key: global shape}`` of every tensor in the checkpoint at ``path``.

    Raises:
        CheckpointError: its metadata cannot be read (named).
    """
    try:
        stored = dist_checkpointing.load_tensors_metadata(str(path))
    except Exception as exc:
        raise unreadable(Path(path) / ".metadata", exc,
                         "a torch_dist checkpoint's metadata") from exc
    return {key: tuple(sh.global_shape) for key, sh in stored.items()}


def check_shapes(sharded_state: dict, path, stored: dict | None = None,
                 skip_prefixes: tuple = ()) -> dict:
    """Compare every requested tensor's global shape with the checkpoint's, before loading.

    Tensors megatron marks ``allow_shape_mismatch`` (vocab rows padded per TP) are skipped, and
    absent keys starting with one of ``skip_prefixes``, after a chained optimizer's
    ``chained_<i>.`` (main params, which
    ``ckpt.adapt.optim_checkpoint`` maps between optimizer kinds) are not reported.
    Every rank reads the same metadata and so raises the same error.

    Args:
        stored: the checkpoint's ``{key: global shape}`` (read from ``path`` when None).

    Returns:
        ``stored``.

    Raises:
        CheckpointError: naming the first tensors whose shapes differ (both shapes) or that the
            checkpoint lacks.
    """
    if stored is None:
        stored = stored_shapes(path)
    wrong, absent = [], []
    for sh in nested_values(sharded_state):
        if not isinstance(sh, ShardedTensor) or sh.allow_shape_mismatch:
            continue
        if sh.key not in stored:
            # A chained optimizer's keys carry its "chained_<i>." prefix.
            if not without_chain_prefix(sh.key).startswith(skip_prefixes):
                absent.append(sh.key)
        elif tuple(stored[sh.key]) != tuple(sh.global_shape):
            wrong.append(f"{sh.key}: checkpoint {tuple(stored[sh.key])}, "
                         f"this model {tuple(sh.global_shape)}")
    if wrong:
        raise CheckpointError(
            f"{path} holds a differently shaped model: " + "; ".join(sorted(set(wrong))[:5])
            + " (check model.* against the checkpoint's run config)")
    if absent:
        raise CheckpointError(f"{path} lacks tensors this model needs: {sorted(set(absent))[:10]}")
    return stored
