"""Read a torch_dist checkpoint's object items without running code from the file, and never
read a ``common.pt`` (megatron-core's legacy common-state file).

A torch DCP checkpoint stores each object item (megatron's ``ShardedObject``: the common state,
each rank's RNG state, the layers' ``_extra_state``; torch DCP's ``BYTE_IO`` items) as a
``torch.save`` record. torch's ``DefaultLoadPlanner.load_bytes`` (torch 2.14; megatron's
``MCoreLoadPlanner`` inherits it, and megatron-core 0.19.2's ``load_common_state_dict`` uses the
default planner) unpickles each with ``torch.load(weights_only=False)``: a crafted record runs
any callable it names. :func:`install` replaces ``load_bytes`` with :func:`load_object`, which
first reads every global the record's pickle names (:func:`ckpt.format.zip_records.check_globals`,
without unpickling) and refuses any outside :func:`ckpt.format.zip_records.allowed_global`'s list, then
unpickles with
``torch.load(weights_only=True)``. The list is exactly what this project's objects hold
(tensors and their storages, dtypes, ``OrderedDict``, ``torch.Size``, ``torch.device``, plain
python values): torch's own weights-only list grows with every module that registers a class
(``torch.distributed.tensor`` adds ``DeviceMesh`` and ``DTensor``, whose constructors may join
a process group; megatron-core adds exceptions, enums, ``argparse.Namespace``), none of which a
checkpoint of this project holds. Anything else is refused with :class:`UnsafeObjectError`,
naming the item and the global, before any of it runs. With
:func:`ckpt.format.safe_metadata.install` (which :func:`install` also calls) no byte of a checkpoint is
unpickled except by a restricted unpickler.

megatron-core 0.19.2's ``load_common_state_dict`` reads a ``common.pt`` in the iter dir, when
there is one, in place of the common state the save wrote into the data files (the format of
checkpoints older than megatron-core 0.19; gtp-recipes never writes one). :func:`install` makes
megatron refuse it (:class:`StrayCommonStateError`, naming the file); :func:`stray_common_state`
is the check ``gtp verify`` and every load make before reading anything.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Optional

from ckpt.format import zip_records
from mcore_compat.patches import megatron_patch

COMMON_STATE_FNAME = "common.pt"  # megatron-core's COMMON_STATE_FNAME


class UnsafeObjectError(ValueError):
    """A checkpoint's object item is not plain data (it names a callable or class outside
    :func:`ckpt.format.zip_records.allowed_global`'s list or ``torch.load``'s weights-only set, or is no
    ``torch.save`` zip record at all): refused, unrun."""


def check_globals(stream, offset: int, length: int, item: str) -> None:
    """:func:`ckpt.format.zip_records.check_globals` of the record ``item``, refused as
    :class:`UnsafeObjectError` (naming it): every global its pickle names is one this project's
    objects hold (:func:`ckpt.format.zip_records.allowed_global`), read without unpickling.

    Raises:
        UnsafeObjectError: a global outside the list (named), an opcode that fetches one
            otherwise, a malformed pickle, or no zip record (the legacy format, which no save of
            this project writes).
    """
    try:
        zip_records.check_globals(stream, offset, length)
    except ValueError as exc:
        raise UnsafeObjectError(f"object {item!r} {_what(exc)}: refused before anything in it "
                                f"ran (a crafted, foreign or damaged checkpoint)") from None


def _what(exc: ValueError) -> str:
    if isinstance(exc, zip_records.ForbiddenGlobal):
        return str(exc)
    if isinstance(exc, zip_records.NotZipRecord):
        return (f"is no torch.save zip record ({exc}; a legacy-format record, which no save of "
                f"this project writes, or damage)")
    return f"is damaged: {exc}"


class StrayCommonStateError(ValueError):
    """An iter dir holds a ``common.pt``, which megatron would read in place of the common state
    the save wrote."""


def load_object(value: io.BytesIO, item: str) -> object:
    """``value`` (one object record's bytes), its globals checked (:func:`check_globals`),
    unpickled by ``torch.load(weights_only=True)``.

    Args:
        value: the record, a ``torch.save`` stream (torch DCP hands a ``BytesIO``).
        item: its name for an error (torch DCP's ``fqn``, e.g. ``'common_state/shard_0_1'``).

    Returns:
        The object (tensors are loaded where ``torch.save`` placed them, as torch's own
        ``load_bytes`` does).

    Raises:
        UnsafeObjectError: the record names a global outside the project's list or
            one ``weights_only`` does not allow (named), is no zip record (legacy format),
            or is refused by the weights-only unpickler otherwise, or is a zip archive with a
            compressed entry (``torch.load`` would inflate it; ``torch.save`` never writes
            one) or one larger than the record; nothing in it ran, nothing was inflated.
        RuntimeError, EOFError: a torn record (as ``torch.load``).
    """
    import torch

    start = value.tell()
    length = value.seek(0, io.SEEK_END) - start
    try:
        zip_records.check_stored(value, start, length)  # and its globals
    except ValueError as exc:
        raise UnsafeObjectError(f"object {item!r} {_what(exc)}: refused before torch.load read "
                                f"it (a crafted, foreign or damaged checkpoint)") from None
    value.seek(start)
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found:
            what = (f"names {found.group(1)}, which no checkpoint object needs (they hold "
                    f"tensors and plain python values only)")
        else:
            detail = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)",
                               text, re.S)
            detail = " ".join(detail.group(1).split()) if detail else text.splitlines()[0]
            what = f"is not plain data a weights-only unpickler reads ({detail})"
        raise UnsafeObjectError(
            f"object {item!r} {what}: refused before anything in it ran (a crafted, foreign or "
            f"damaged checkpoint)") from None


def stray_common_state(path) -> Optional[str]:
    """What is wrong with ``<path>/common.pt`` (``path``: an iter dir; the message does not
    name the file), or None when there is none."""
    stray = Path(path) / COMMON_STATE_FNAME
    if not (stray.exists() or stray.is_symlink()):
        return None
    return ("a legacy common-state file (megatron-core's term), which megatron-core would read "
            "in place of the common state this checkpoint's save wrote into its data files "
            "(gtp-recipes never writes one): damage or tampering; move it out of the dir to "
            "load the saved common state, or load another iteration")


def refusal(exc: BaseException) -> Optional[BaseException]:
    """The :class:`UnsafeObjectError` or :class:`StrayCommonStateError` behind ``exc`` (its
    causes, and each rank's error of torch DCP's ``CheckpointException``), else None."""
    seen, todo = set(), [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, (UnsafeObjectError, StrayCommonStateError)):
            return error
        todo += [error.__cause__, error.__context__]
        for failure in (getattr(error, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def _load_bytes(self, read_item, value) -> None:
    """torch's ``DefaultLoadPlanner.load_bytes`` (torch 2.14) with :func:`load_object`."""
    loaded = load_object(value, read_item.storage_index.fqn)
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


def _refuse_common_pt(checkpoint_dir):
    """In place of megatron's ``load_common`` (the reader of its legacy ``common.pt``)."""
    raise StrayCommonStateError(f"{Path(checkpoint_dir) / COMMON_STATE_FNAME}: "
                                f"{stray_common_state(checkpoint_dir) or 'not read'}")


@megatron_patch("dist_checkpointing.serialization.load_common (load_common_state_dict's reader "
                "of a legacy common.pt: refused); torch DCP's DefaultLoadPlanner.load_bytes")
def install() -> None:
    """Route every torch DCP object read (``DefaultLoadPlanner.load_bytes``, which megatron's
    ``load_common_state_dict`` and ``dist_checkpointing.load`` reach) through
    :func:`load_object`, make megatron's ``load_common_state_dict`` refuse a ``common.pt``
    (:class:`StrayCommonStateError`), and :func:`ckpt.format.safe_metadata.install`. Idempotent."""
    from megatron.core.dist_checkpointing import serialization
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckpt.format import safe_metadata

    safe_metadata.install()
    if not getattr(DefaultLoadPlanner.load_bytes, "_restricted", False):
        _load_bytes._restricted = True
        DefaultLoadPlanner.load_bytes = _load_bytes
    serialization.load_common = _refuse_common_pt
