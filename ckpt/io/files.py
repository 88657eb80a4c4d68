"""The files of a checkpoint dir: names, the tracker, durable writes, disk space, retention.

Folder structure (Megatron-LM's)::

    <save>/iter_0000020/                      megatron dist_checkpointing (torch_dist) files
    <save>/.iter_0000020.staging/             a save being written (hidden; never loaded)
    <save>/latest_checkpointed_iteration.txt  written only after every rank finished the save
    <save>/.lineage.json                      each save's lineage (ckpt.io.lineage)
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from ckpt.format.records import TRACKER
from ckpt.io.errors import CheckpointError

ITER_NAME = re.compile(r"iter_(\d{7,})")

# Checkpoint files add metadata and alignment to the raw tensor bytes; ask for this much more
# (a 2-rank tiny GPT save: 1.82 MiB of tensors, 1.97 MiB of files).
SPACE_MARGIN = 1.10
SPACE_SLACK_BYTES = 256 << 10
FILE_SLACK_BYTES = 16 << 10  # per file: a partly used last block


def save_files(world_size: int) -> int:
    """Files (inodes) one save creates: up to two data files per rank (megatron's writer
    threads), ``.metadata``, ``metadata.json``, the staging dir and the temp files of the tracker
    and the lineage record."""
    return 2 * int(world_size) + 5


def iter_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``<root>/iter_0000020`` (Megatron-LM's 7-digit name)."""
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root, iteration: int) -> Path:
    """``<root>/.iter_0000020.staging``: where a save is written before it is renamed into place.

    Hidden, so nothing that lists ``iter_*`` (loading, retention, the tracker) ever sees it.
    """
    return Path(root) / f".{iter_dir(root, iteration).name}.staging"


def check_root(root: Path) -> None:
    """``root`` must be a checkpoint dir (the parent of ``iter_*`` dirs).

    Raises:
        CheckpointError: it is a file, missing or one ``iter_*`` dir (with the command to use).
    """
    if root.is_file():
        raise CheckpointError(f"checkpoint.load={str(root)!r} is a file, not a directory: point it "
                              f"at the 'checkpoints' dir of a run")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint.load={str(root)!r}: no such directory")
    if ITER_NAME.fullmatch(root.name):
        raise CheckpointError(
            f"checkpoint.load={str(root)!r} is one saved iteration, not a checkpoint dir: use "
            f"checkpoint.load={str(root.parent)!r} checkpoint.load_iteration={int(root.name[5:])}")


def read_tracker(root: str | os.PathLike) -> int:
    """The iteration named by ``<root>/latest_checkpointed_iteration.txt``.

    Raises:
        CheckpointError: the dir or tracker is missing/empty/garbled (not UTF-8, not a number),
            ``root`` is a file or an ``iter_*`` dir, or the tracker names an iteration whose
            folder is missing.
    """
    root = Path(root)
    check_root(root)
    tracker = root / TRACKER
    if not tracker.is_file():
        found = sorted(p.name for p in root.glob("iter_*"))
        hint = f" (it holds {found} but no complete save)" if found else " (it is empty)"
        advice = "point it at the 'checkpoints' dir of a run that finished at least one save"
        if saved_iterations(root):  # a crash between a save's rename and the tracker's write
            hint = f" (its complete saves: iterations {saved_iterations(root)})"
            advice = "load one with checkpoint.load_iteration=N, or use checkpoint.load=auto"
        raise CheckpointError(f"checkpoint.load={str(root)!r} has no {TRACKER}{hint}: {advice}")
    raw = tracker.read_bytes()
    try:
        text = raw.decode("utf-8").strip()
        iteration = int(text)
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{tracker}: expected an iteration number, found {raw[:40]!r}") from None
    if not iter_dir(root, iteration).is_dir():
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iter_dir(root, iteration)} is missing")
    return iteration


def tracked(root) -> int | None:
    """:func:`read_tracker`, or None where it raises (no complete save, garbled tracker)."""
    try:
        return read_tracker(root)
    except CheckpointError:
        return None


def saved_iterations(root) -> list[int]:
    """Iterations of ``root`` whose ``iter_*`` dir holds a complete save (megatron's two
    metadata files), ascending. Staging dirs are hidden and never listed."""
    found = []
    for p in Path(root).glob("iter_*"):
        match = ITER_NAME.fullmatch(p.name)
        if match and all((p / name).is_file() for name in ("metadata.json", ".metadata")):
            found.append(int(match.group(1)))
    return sorted(found)


def write_durable(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a unique temp file beside it, fsync,
    rename, fsync of the dir. Readers see the old or the new content, never a torn one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path) -> None:
    """fsync a directory, so renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_disk_space(root, needed_bytes: int, free_bytes: int | None = None,
                      files: int = 0) -> None:
    """Refuse to start a save that cannot fit, instead of leaving a half-written checkpoint:
    its bytes (tensor bytes, plus :data:`SPACE_MARGIN`, :data:`SPACE_SLACK_BYTES` and
    :data:`FILE_SLACK_BYTES` per file) and its inodes (``files``), where the file system counts
    them (``statvfs``; one that reports no inodes, ``f_files == 0``, is not asked).

    Args:
        root: the checkpoint dir (or the nearest existing parent is measured).
        needed_bytes: tensor bytes of the save
            (:func:`ckpt.io.save.expected_checkpoint_bytes`).
        free_bytes: free bytes to assume (tests); default: measured.
        files: the files the save creates (:func:`save_files`).

    Raises:
        CheckpointError: naming the dir, what is free and what is needed.
    """
    target = Path(root)
    while not target.exists() and target != target.parent:
        target = target.parent
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize if free_bytes is None else free_bytes
    needed = int(needed_bytes * SPACE_MARGIN) + SPACE_SLACK_BYTES + files * FILE_SLACK_BYTES
    if free < needed:
        raise CheckpointError(
            f"not enough disk space to save a checkpoint in {root}: {free / 2**20:.1f} MiB free, "
            f"about {needed / 2**20:.1f} MiB needed; free space or set checkpoint.save elsewhere "
            f"(checkpoint.keep_last=K removes older saves)"
        )
    if st.f_files and st.f_favail < files:
        raise CheckpointError(
            f"not enough inodes to save a checkpoint in {root}: {st.f_favail} free, {files} "
            f"needed (one per file); remove files on that file system or set checkpoint.save "
            f"elsewhere (checkpoint.keep_last=K removes older saves)")


def recover_replaced(root) -> list[Path]:
    """Put back a complete checkpoint that a crash left as ``.iter_*.replaced`` (its
    replacement never got renamed into place); returns the dirs restored."""
    restored = []
    for aside in Path(root).glob(".iter_*.replaced"):
        target = Path(root) / aside.name[1:-len(".replaced")]
        if not target.exists():
            os.replace(aside, target)
            restored.append(target)
    return restored


def remove_old_checkpoints(root, keep_last: int, keep: tuple[int, ...] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (rank 0 only).

    Counts only complete saves (:func:`saved_iterations`); never removes the one the tracker
    names, nor those in ``keep``, nor anything incomplete (staging dirs are hidden).
    """
    current = read_tracker(root)
    done = saved_iterations(root)
    removed = []
    for it in done[:-keep_last] if keep_last else []:
        if it != current and it not in keep:
            shutil.rmtree(iter_dir(root, it))
            removed.append(iter_dir(root, it))
    return removed
