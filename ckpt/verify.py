"""Check every byte a load of a ``torch_dist`` checkpoint reads: ``python -m gtp verify CKPT``.

What is checked, for one ``iter_XXXXXXX`` dir (``docs/integrity.md`` says what is not):

* ``metadata.json`` is megatron's JSON naming the ``torch_dist`` backend;
* ``.metadata`` unpickles through :mod:`ckpt.format.safe_metadata`, and is consistent: every chunk of
  every tensor and every object has a stored record, every record belongs to an item, a
  tensor's chunks lie inside it and cover it exactly once, and record names are plain file
  names of the dir;
* the data files: their records cover each file exactly (no gap, no overlap, nothing after the
  last, nothing missing: a truncated file is named with the first item it cuts); every entry of
  every record matches the CRC-32 its zip directory holds (:func:`ckpt.format.zip_records.check_record`;
  ``torch.save`` writes one per entry); each tensor record holds the dtype and shape
  ``.metadata`` gives its chunk and its pickle names only the globals this project's records
  hold (:func:`ckpt.format.zip_records.check_globals`); each object record (the common state, every RNG
  state and ``_extra_state``) loads as the load reads it (:func:`ckpt.format.safe_objects.load_object`);
* no ``common.pt`` lies in the dir (megatron would read it in place of the saved common state;
  :func:`ckpt.format.safe_objects.stray_common_state`);
* the common state loads (megatron's ``load_common_state_dict``, its record unpickled with
  ``weights_only=True``: :mod:`ckpt.format.safe_objects`), its ``iteration`` is the dir's, and no size
  of its saved run config exceeds every stored shape (:func:`ckpt.format.records.unbounded_size`);
* a checkpoint root's tracker (``latest_checkpointed_iteration.txt``) holds an iteration whose
  dir is complete.

Each problem names the file and, where there is one, the item (tensor key and chunk offsets).
:func:`check_metadata` and :func:`check_data_files` are the pieces a multi-rank load uses to
share the work (:func:`share`); :func:`verify_iteration` runs all of them in one process.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from ckpt.format import safe_objects, zip_records
from ckpt.format.records import TRACKER, unbounded_size
from ckpt.format.safe_objects import COMMON_STATE_FNAME, stray_common_state

ITER_NAME = re.compile(r"iter_(\d{7,})")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        file: the damaged file (or dir).
        item: the item in it (e.g. ``tensor 'embedding.word_embeddings.weight', the chunk at
            (0, 0)``), empty when the problem is the file's.
        what: what is wrong.
    """

    file: str
    item: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.item}: {self.what}" if self.item else f"{self.file}: {self.what}"


class CheckpointDamaged(ValueError):
    """A checkpoint failed verification; ``problems`` lists what (the message, the first few)."""

    def __init__(self, path, problems: list[Problem]):
        self.path, self.problems = Path(path), list(problems)
        shown = "; ".join(str(p) for p in self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"{path} is damaged: {shown}{more}")


@dataclasses.dataclass
class Report:
    """What :func:`verify_iteration` checked in one iter dir, and the problems it found."""

    path: Path
    problems: list[Problem] = dataclasses.field(default_factory=list)
    files: int = 0
    records: int = 0
    entries: int = 0
    bytes: int = 0
    items: int = 0
    iteration: Optional[int] = None

    def summary(self) -> str:
        """One line: what was checked."""
        return (f"{self.path}: {self.items} items of .metadata consistent; {self.files} data "
                f"files, {self.bytes} bytes in {self.records} records, the CRC-32 of every one "
                f"of their {self.entries} zip entries checked; common state of iteration "
                f"{self.iteration} readable")


def _describe(fqn: str, offsets) -> str:
    if offsets is None:
        return f"object {fqn!r}"
    return f"tensor {fqn!r}, the chunk at {tuple(int(o) for o in offsets)}"


METADATA_JSON_LIMIT = 1 << 20  # bytes of metadata.json read at most


def read_metadata(path) -> tuple[Any, list[Problem]]:
    """``(metadata, problems)`` of ``<path>/.metadata`` (metadata None when it cannot be read)."""
    from ckpt.format.safe_metadata import read_metadata as read

    path = Path(path)
    problems = []
    try:
        file = path / "metadata.json"
        if not file.is_file():  # a FIFO or device would block or never end
            if file.exists() or file.is_symlink():
                raise ValueError("not a regular file")
            raise FileNotFoundError(file)
        with open(file, "rb") as f:
            text = f.read(METADATA_JSON_LIMIT + 1)
        if len(text) > METADATA_JSON_LIMIT:
            raise ValueError(f"over {METADATA_JSON_LIMIT} bytes (megatron writes about 100)")
        meta = json.loads(text)
        if not isinstance(meta, dict) or meta.get("sharded_backend") != "torch_dist":
            problems.append(Problem(str(path / "metadata.json"), "",
                                    f"not a torch_dist checkpoint's ({meta!r:.80})"))
    except FileNotFoundError:
        problems.append(Problem(str(path / "metadata.json"), "", "missing"))
    except (OSError, ValueError) as exc:
        problems.append(Problem(str(path / "metadata.json"), "", f"unreadable: {exc}"))
    if not (path / ".metadata").is_file():
        return None, problems + [Problem(str(path / ".metadata"), "", "missing")]
    try:
        return read(path), problems
    except Exception as exc:  # noqa: BLE001 - a torn or foreign .metadata, named
        return None, problems + [Problem(str(path / ".metadata"), "",
                                         f"unreadable: {type(exc).__name__}: {exc}")]


def check_metadata(path, metadata) -> list[Problem]:
    """Problems of ``.metadata``'s consistency with itself and the dir's files (their names and
    sizes only; no data read).

    Args:
        path: the iter dir; metadata: its unpickled ``.metadata`` (torch DCP's ``Metadata``).

    Returns:
        The problems, each naming ``.metadata`` or a data file and the item.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from ckpt.format.safe_metadata import tiling_problems

    path = Path(path)
    source = str(path / ".metadata")
    problems: list[Problem] = []
    storage = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
               for index, info in (metadata.storage_data or {}).items()}
    wanted = set()
    for fqn, item in (metadata.state_dict_metadata or {}).items():
        if isinstance(item, BytesStorageMetadata):
            wanted.add((fqn, None))
            if (fqn, None) not in storage:
                problems.append(Problem(source, _describe(fqn, None), "has no stored record"))
            continue
        if not isinstance(item, TensorStorageMetadata):
            problems.append(Problem(source, fqn, f"unknown item {type(item).__name__}"))
            continue
        size = tuple(item.size)
        if len(item.chunks) > len(storage):  # each chunk needs a record of its own
            problems.append(Problem(source, f"tensor {fqn!r}", (
                f"has {len(item.chunks)} chunks, more than the {len(storage)} stored records "
                f"of the whole checkpoint")))
            wanted.update(key for key in storage if key[0] == fqn)  # named once, here
            continue
        for chunk in item.chunks:
            key = (fqn, tuple(chunk.offsets))
            wanted.add(key)
            if key not in storage:
                problems.append(Problem(source, _describe(*key), "has no stored record"))
        problems += [Problem(source, f"tensor {fqn!r}", what)
                     for what in tiling_problems(size, item.chunks)]
    for key in sorted(set(storage) - wanted, key=str):
        problems.append(Problem(source, _describe(*key), "a stored record of no item"))

    stray = stray_common_state(path)
    if stray:
        problems.append(Problem(str(path / COMMON_STATE_FNAME), "", stray))
    for name in sorted({info.relative_path for info in storage.values()}):
        if Path(name).name != name or name in ("", ".", ".."):
            problems.append(Problem(source, "", f"names data file {name!r} outside its dir"))
        elif not (path / name).is_file():
            problems.append(Problem(str(path / name), "", "missing (.metadata places records "
                                                          "in it)"))
    return problems


def share(metadata, rank: int, world: int) -> list[str]:
    """The data files rank ``rank`` of ``world`` checks: every file once over the ranks,
    balanced by bytes (largest first, each to the rank with the fewest bytes so far)."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = sizes.get(info.relative_path, 0) + info.length
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def check_data_files(path, metadata, names: Optional[Iterable[str]] = None,
                     report: Optional[Report] = None) -> list[Problem]:
    """Read every byte of the data files ``names`` (default all) and check them.

    Args:
        path: the iter dir; metadata: its ``.metadata``.
        names: data file names (relative to ``path``); see :func:`share`.
        report: counts (files, records, entries, bytes) are added to it when given.

    Returns:
        The problems, each naming the file and the item.
    """
    path = Path(path)
    chunks = _chunk_metadata(metadata)
    by_file: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        by_file.setdefault(info.relative_path, []).append(
            (info.offset, info.length, index, bool(info.transform_descriptors)))
    problems: list[Problem] = []
    buffer = bytearray(zip_records.CHECK_BLOCK)
    for name in sorted(by_file if names is None else names):
        file = path / name
        if Path(name).name != name or not file.is_file():
            continue  # check_metadata names it
        records = sorted(by_file.get(name, []), key=lambda r: (r[0], r[1]))
        size = file.stat().st_size
        if report is not None:
            report.files += 1
            report.bytes += size
        end, last = 0, None
        with open(file, "rb") as stream:
            for offset, length, index, transformed in records:
                item = _describe(index.fqn, index.offset)
                if (offset, length) == last:  # two items of one record: checked once
                    continue
                last = (offset, length)
                if offset != end:
                    what = (f"bytes {end} to {offset} belong to no record" if offset > end else
                            f"overlaps the record before it (starts at byte {offset}, that one "
                            f"ends at {end})")
                    problems.append(Problem(str(file), item, what))
                end = max(end, offset + length)
                if offset + length > size:
                    problems.append(Problem(str(file), item, (
                        f"the file has {size} bytes, but .metadata places this record at bytes "
                        f"{offset} to {offset + length}: the file is truncated")))
                    break
                if transformed:  # DCP transforms (e.g. compression): no zip record to check
                    continue
                problems += [Problem(str(file), item, what) for what in
                             _check_one(stream, offset, length, index, chunks, buffer, report)]
            else:
                if end != size:
                    problems.append(Problem(str(file), "", (
                        f"{size - end} bytes after its last record (byte {end}): not written "
                        f"by this checkpoint's save")))
    return problems


def _chunk_metadata(metadata) -> dict:
    """(fqn, offsets) -> (dtype, chunk sizes) of every tensor chunk in ``metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for fqn, item in (metadata.state_dict_metadata or {}).items():
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                out[(fqn, tuple(chunk.offsets))] = (item.properties.dtype, tuple(chunk.sizes))
    return out


def _check_one(stream, offset, length, index, chunks, buffer, report) -> list[str]:
    """Problems of one record: its zip entries' CRC-32s, and a tensor's dtype and shape."""
    from ckpt.format import dcp_reader

    try:
        entries = zip_records.check_record(stream, offset, length, buffer)
    except zip_records.RecordDamaged as exc:
        return [str(exc)]
    except (ValueError, OSError) as exc:
        return [f"not a torch.save record, so nothing to check its bytes against ({exc}): "
                f"its header is damaged or another writer stored it"]
    if report is not None:
        report.records += 1
        report.entries += entries
    if index.offset is None:
        return _object_problems(stream, offset, length, index.fqn)
    try:  # what torch's reader would unpickle of a tensor record it reads whole
        zip_records.check_globals(stream, offset, length)
    except zip_records.ForbiddenGlobal as exc:
        return [str(exc)]
    want = chunks.get((index.fqn, tuple(index.offset)))
    if want is None:
        return []  # check_metadata names it
    try:
        record = dcp_reader.read_record(stream, offset, length)
        dtype, shape = record.dtype, tuple(record.size)
    except ValueError:  # not one plain tensor: what torch's reader makes of it
        dtype, shape = _torch_loaded(stream, offset, length)
    if (dtype, shape) != want:
        return [f"the record holds a {dtype} tensor of shape {shape}, .metadata says "
                f"{want[0]} {want[1]}"]
    return []


def _object_problems(stream, offset, length, fqn) -> list[str]:
    """What the load's :func:`ckpt.format.safe_objects.load_object` refuses in the object record
    ``fqn`` (the common state, an RNG state, an ``_extra_state``): empty when it loads."""
    stream.seek(offset)
    try:
        safe_objects.load_object(io.BytesIO(stream.read(length)), fqn)
    except safe_objects.UnsafeObjectError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - a torn record, as the load would fail on it
        return [f"cannot be loaded ({type(exc).__name__}: {str(exc)[:200]})"]
    return []


def _torch_loaded(stream, offset, length):
    import torch

    stream.seek(offset)
    try:
        tensor = torch.load(io.BytesIO(stream.read(length)), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported as what the record holds
        return f"unloadable record ({type(exc).__name__})", ()
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__, ()
    return tensor.dtype, tuple(tensor.shape)


def check_common(path) -> tuple[Optional[dict], list[Problem]]:
    """``(common state, problems)``: megatron's ``load_common_state_dict`` of ``path`` (read
    through :mod:`ckpt.format.dcp_reader`, CRC-checked) and whether its ``iteration`` is the dir's."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt.format import dcp_reader

    path = Path(path)
    if safe_objects.stray_common_state(path):
        return None, []  # check_metadata reports it; megatron would read it, not the saved state
    if not (path / "metadata.json").is_file():
        return None, []  # read_metadata reports it; megatron's open of a FIFO would block
    safe_objects.install()
    dcp_reader.install()
    try:
        common = dict(dist_checkpointing.load_common_state_dict(str(path)))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - named below
        errors = getattr(exc, "failures", None)
        text = "; ".join(str(f[0] if isinstance(f, tuple) else f) for f in errors.values()) \
            if errors else f"{type(exc).__name__}: {exc}"
        return None, [Problem(str(path), "object 'common_state'",
                              f"the common state cannot be loaded: {text}")]
    match = ITER_NAME.fullmatch(path.name)
    if match and common.get("iteration") != int(match.group(1)):
        return common, [Problem(str(path), "object 'common_state'",
                                f"records iteration {common.get('iteration')!r}, the dir is "
                                f"{path.name}")]
    return common, []


def check_tracker(root) -> tuple[Optional[int], list[Problem]]:
    """``(iteration, problems)`` of ``<root>/latest_checkpointed_iteration.txt``: a number naming a
    complete iter dir."""
    tracker = Path(root) / TRACKER
    raw = tracker.read_bytes()
    try:
        iteration = int(raw.decode("utf-8").strip())
    except ValueError:
        return None, [Problem(str(tracker), "", f"holds no iteration number: {raw[:40]!r}")]
    path = Path(root) / f"iter_{iteration:07d}"
    missing = [n for n in ("metadata.json", ".metadata") if not (path / n).is_file()]
    if not path.is_dir() or missing:
        what = "is missing" if not path.is_dir() else f"lacks {', '.join(missing)}"
        return iteration, [Problem(str(tracker), "", f"names iteration {iteration}, but {path} "
                                                     f"{what}")]
    return iteration, []


def verify_iteration(path) -> Report:
    """Every check of the module on one iter dir, in this process (reads every byte)."""
    path = Path(path)
    report = Report(path)
    metadata, report.problems = read_metadata(path)
    if metadata is not None:
        report.items = len(metadata.state_dict_metadata or {})
        report.problems += check_metadata(path, metadata)
        report.problems += check_data_files(path, metadata, report=report)
        common, problems = check_common(path)
        report.problems += problems
        report.iteration = None if common is None else common.get("iteration")
        unbounded = None if common is None else unbounded_size(common, stored_shapes(metadata))
        if unbounded:
            report.problems.append(Problem(str(path), "object 'common_state'", unbounded))
    return report


def stored_shapes(metadata) -> list[tuple]:
    """The global shape of every tensor ``metadata`` (a DCP ``Metadata``) lists."""
    return [tuple(item.size) for item in (metadata.state_dict_metadata or {}).values()
            if hasattr(item, "chunks")]


def check_share(path, rank: int = 0, world: int = 1) -> list[Problem]:
    """What rank ``rank`` of ``world`` checks before a load: ``metadata.json`` and ``.metadata``
    (every rank: no data read) and its :func:`share` of the data files (every byte of them).
    Over the ranks, every data file is read once. The common state is not loaded here: a load
    reads it anyway (CRC-checked by :mod:`ckpt.format.dcp_reader`)."""
    metadata, problems = read_metadata(path)
    if metadata is None:
        return problems
    problems += check_metadata(path, metadata)
    return problems + check_data_files(path, metadata, share(metadata, rank, world))


def iteration_dirs(ckpt, all_iterations: bool = False) -> tuple[list[Path], list[Problem]]:
    """The iter dirs to verify for ``ckpt`` and the tracker's problems.

    Args:
        ckpt: a checkpoint root (its tracker's iteration; every complete ``iter_*`` dir with
            ``all_iterations``) or one iter dir (its root's tracker checked too, if it has one).

    Raises:
        FileNotFoundError: ``ckpt`` is neither (names what it lacks).
    """
    ckpt = Path(ckpt)
    root = ckpt.parent if ITER_NAME.fullmatch(ckpt.name) else ckpt
    tracked, problems = (check_tracker(root) if (root / TRACKER).is_file() else (None, []))
    if root is not ckpt:
        if not ckpt.is_dir():
            raise FileNotFoundError(f"{ckpt}: no such checkpoint dir")
        return [ckpt], problems
    if all_iterations:
        dirs = sorted(p for p in root.glob("iter_*") if ITER_NAME.fullmatch(p.name) and p.is_dir())
        if dirs:
            return dirs, problems
    if tracked is None and not problems:
        raise FileNotFoundError(
            f"{ckpt}: not a checkpoint root (no {TRACKER}) nor an iter_XXXXXXX dir")
    path = None if tracked is None else root / f"iter_{tracked:07d}"
    return ([path] if path is not None and path.is_dir() else []), problems
