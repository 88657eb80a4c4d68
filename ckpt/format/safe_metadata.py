"""Read a torch_dist checkpoint's ``.metadata`` without running code from the file.

DCP stores its metadata as a pickle, and a pickle can name any callable to run on load. This
reader (a subclass of python's own ``pickle._Unpickler``) resolves only the ``(module, name)``
pairs of :data:`ALLOWED` (DCP's metadata dataclasses, ``_StorageInfo``, ``torch.Size``,
``torch.device``, dtypes, a few builtins and containers), each checked to be the object the
list means; a name with a ``.`` in it (protocol 4's dotted names reach any attribute of an
allowed module) is refused. Calls (``REDUCE``, ``NEWOBJ``) may only target allowed classes and
callables; ``BUILD`` (state set on an object) only an instance of an allowed class, with no
slot state; ``INST``/``OBJ`` and persistent ids are refused. A refusal
(:class:`UnsafeMetadataError`) names the file and the global or opcode, before anything the
file names is called.

The metadata read is also confined: every ``storage_data`` entry's ``relative_path`` must be a
plain file name in the checkpoint dir (no ``/``, no ``..``, not absolute), and a data file that
is a symlink must resolve inside the dir. :func:`install` routes every DCP metadata read
through it. The data files' object items are unpickled with ``torch.load(weights_only=True)``
once :func:`ckpt.format.safe_objects.install` ran (which also runs this module's :func:`install`).

:func:`tiling_problems` checks that a tensor's chunks, as ``.metadata`` lists them, cover it
exactly once, in O(n log n) of the chunks (``gtp verify`` and every verified load run it).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import heapq
import importlib
import io
import logging
import math
import os
import pickle
import struct
import threading
from pathlib import Path
from typing import Optional

import torch


_DCP = "torch.distributed.checkpoint."
# (module, name) -> the kind of object it must resolve to: "class" (a class of that name) or
# "function" (a function of that name); and ("torch", <a dtype's name>). No tensor: torch's
# own reducer of a pickled storage (torch.storage._load_from_bytes) calls torch.load with
# weights_only=False, and DCP's metadata holds none.
ALLOWED = {
    **{(_DCP + "metadata", n): "class" for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")},
    **{(_DCP + "planner", n): "class" for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
    **{(_DCP + "filesystem", n): "class" for n in ("_StorageInfo", "_StoragePrefix")},
    # megatron-core's empty classes for older checkpoints' metadata
    **{("megatron.core.dist_checkpointing.strategies.torch", n): "class" for n in (
        "MCoreMetadata", "MCoreSavePlan")},
    ("torch", "Size"): "class",
    ("torch", "device"): "class",
    ("torch.serialization", "_get_layout"): "function",
    ("collections", "OrderedDict"): "class",
    ("collections", "defaultdict"): "class",
    ("builtins", "set"): "class",
    ("builtins", "frozenset"): "class",
    ("builtins", "slice"): "class",
    ("builtins", "complex"): "class",
    ("pathlib", "PosixPath"): "class",
    ("pathlib", "PurePosixPath"): "class",
    ("datetime", "timedelta"): "class",
}


class UnsafeMetadataError(ValueError):
    """A ``.metadata`` file names a global outside the allowed list, calls or sets state on
    something it may not, or names a data file outside its checkpoint dir."""


def _resolve(module: str, name: str):
    """The object :data:`ALLOWED` means by ``(module, name)``, or None when it allows none."""
    kind = ALLOWED.get((module, name))
    dtype = (module == "torch" and name.isidentifier()
             and isinstance(getattr(torch, name, None), torch.dtype))
    if kind is None and not dtype:
        return None
    obj = getattr(importlib.import_module(module), name, None)
    if dtype:
        return obj
    if kind == "class":
        ok = isinstance(obj, type) and obj.__name__ == name
    else:
        ok = callable(obj) and not isinstance(obj, type) and getattr(obj, "__name__", "") == name
    return obj if ok else None


class _RestrictedUnpickler(pickle._Unpickler):
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source
        self.resolved = {}  # id -> each object find_class handed out (kept alive)

    def refuse(self, what: str):
        raise UnsafeMetadataError(
            f"{self.source} {what}, which a checkpoint's metadata never needs: refusing to "
            f"load it before anything it names runs (a crafted or foreign file)")

    def load(self):
        """The unpickled object; a malformed stream raises ``UnpicklingError`` (as python's C
        unpickler does) rather than the pure-python one's KeyError or IndexError."""
        try:
            return super().load()
        except (KeyError, IndexError, struct.error) as exc:
            raise pickle.UnpicklingError(f"{self.source}: a malformed pickle "
                                         f"({type(exc).__name__}: {exc})") from None

    def find_class(self, module: str, name: str):
        obj = None if "." in name else _resolve(module, name)
        if obj is None:
            self.refuse(f"names {module}.{name}")
        self.resolved[id(obj)] = obj
        return obj

    def _callable(self, func, opcode: str):
        allowed = self.resolved.get(id(func)) is func and (
            isinstance(func, type) or callable(func)) and not isinstance(func, torch.dtype)
        if not allowed:
            self.refuse(f"calls {func!r} ({opcode})")

    def load_reduce(self):
        self._callable(self.stack[-2], "REDUCE")
        super().load_reduce()
    dispatch[pickle.REDUCE[0]] = load_reduce

    def _instance(self, cls, opcode: str):
        if not isinstance(cls, type):
            self.refuse(f"creates an instance of {cls!r} ({opcode})")
        self._callable(cls, opcode)

    def load_newobj(self):
        self._instance(self.stack[-2], "NEWOBJ")
        super().load_newobj()
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self):
        self._instance(self.stack[-3], "NEWOBJ_EX")
        super().load_newobj_ex()
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        cls = type(inst)
        if isinstance(inst, type) or self.resolved.get(id(cls)) is not cls:
            self.refuse(f"sets state on {inst!r} (BUILD), no instance of an allowed class")
        if isinstance(state, tuple) and len(state) == 2 and state[1] is not None:
            self.refuse(f"sets slot state on a {cls.__name__} (BUILD)")
        if isinstance(state, dict) and any(not isinstance(k, str) or k.startswith("__")
                                           for k in state):
            # e.g. an instance's own __setstate__, which a later BUILD would call
            self.refuse(f"sets a special attribute of a {cls.__name__} (BUILD)")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def _refused_opcode(self):
        if not self.metastack:
            raise pickle.UnpicklingError("could not find MARK")
        self.refuse("uses INST/OBJ (protocol 0/1 object creation)")
    dispatch[pickle.INST[0]] = _refused_opcode
    dispatch[pickle.OBJ[0]] = _refused_opcode

    def persistent_load(self, pid):
        self.refuse(f"holds a persistent id {str(pid)[:60]!r}")


def confine(source: Path, metadata) -> None:
    """Check that every ``storage_data`` entry of ``metadata`` (read from ``source``, a
    ``.metadata`` file) names a plain file of ``source``'s dir, and that each such file that
    is a symlink resolves inside the dir.

    Raises:
        UnsafeMetadataError: naming the item and its ``relative_path``.
    """
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise UnsafeMetadataError(f"{source}: storage_data is a {type(storage).__name__}, "
                                  f"no dict")
    directory = source.parent
    checked = set()
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if name in checked:
            continue
        item = getattr(index, "fqn", index)
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
                or "\\" in name or "\0" in name or os.path.isabs(name)):
            raise UnsafeMetadataError(
                f"{source}: item {item!r} is stored in {name!r}, which is no plain file name in "
                f"the checkpoint dir: refusing to read outside it (a crafted or foreign file)")
        path = directory / name
        if path.is_symlink():
            target, root = os.path.realpath(path), os.path.realpath(directory)
            if os.path.commonpath([target, root]) != root:
                raise UnsafeMetadataError(
                    f"{source}: item {item!r} is stored in {name!r}, a symlink to {target}, "
                    f"outside the checkpoint dir: refusing to read it")
        checked.add(name)
# Per thread, within reused(): ``_THREAD.cache`` maps (device, inode, size, mtime) of a
# .metadata file to its unpickled Metadata (None outside any block).
_THREAD = threading.local()


@contextlib.contextmanager
def reused():
    """Within the block (or the function it decorates), each ``.metadata`` file is unpickled
    once: a later read of the same unchanged file (same device, inode, size and modification
    time) gets a copy of the first read's ``Metadata``.

    One checkpoint load (``ckpt.io.load_checkpoint``) reads a file's metadata six
    times (the storage check, the shape check and four reads inside megatron and torch DCP),
    and the unpickling cost grows with the stored chunks (``benchmarks/README.md``). Each copy has its own top-level
    dicts and ``storage_meta`` (DCP sets ``storage_meta.load_id`` per reader); the per-tensor
    entries are shared, as a single read's are between its users. Nested blocks share the
    outer cache; it is dropped when the outermost block exits. The cache is the calling
    thread's: reads in other threads, and their blocks, neither use nor end it.
    """
    outermost = getattr(_THREAD, "cache", None) is None
    if outermost:
        _THREAD.cache = {}
    try:
        yield
    finally:
        if outermost:
            _THREAD.cache = None


def _load(source: Path):
    """``source`` unpickled by the restricted unpickler (through the :func:`reused` cache)."""
    cache = getattr(_THREAD, "cache", None)
    with open(source, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if cache is not None and key in cache:
            return _copy(cache[key])
        metadata = _RestrictedUnpickler(io.BytesIO(f.read()), source).load()
    confine(source, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    if cache is None:
        return metadata
    cache[key] = metadata
    return _copy(metadata)


def _copy(metadata):
    """A copy of ``metadata`` whose top-level containers and ``storage_meta`` are its own."""
    out = copy.copy(metadata)
    for name in ("state_dict_metadata", "storage_data", "planner_data", "storage_meta"):
        value = getattr(metadata, name, None)
        if value is not None:
            setattr(out, name, copy.copy(value))
    return out


def read_metadata(path) -> object:
    """The unpickled ``<path>/.metadata`` (torch DCP's ``Metadata``; within :func:`reused`,
    a copy of the file's first read).

    Raises:
        UnsafeMetadataError: the file names a global outside the allowed list, calls or sets
            state on something else, or stores an item outside the checkpoint dir.
        OSError, pickle.UnpicklingError, EOFError: a missing or torn file.
    """
    return _load(Path(path) / ".metadata")


def install() -> None:
    """Route torch DCP's ``FileSystemReader.read_metadata`` (which megatron's
    ``load_tensors_metadata``/``load_common_state_dict``/``load`` use) through the restricted
    reader, so no ``.metadata`` pickle runs code whatever reads it first. Idempotent."""
    from torch.distributed.checkpoint import FileSystemReader

    if getattr(FileSystemReader.read_metadata, "_restricted", False):
        return

    def read_metadata_restricted(self, *args, **kwargs):
        metadata = _load(Path(self._get_metadata_path(kwargs.get("rank"))))
        metadata.storage_meta.load_id = self.load_id
        return metadata

    read_metadata_restricted._restricted = True
    FileSystemReader.read_metadata = read_metadata_restricted
    # torch's dcp.load logs a failed read with its traceback on the root logger before it
    # raises it: a refusal is reported once, by whoever catches it.
    logging.getLogger().addFilter(_drop_logged_refusal)


def _drop_logged_refusal(record: logging.LogRecord) -> bool:
    """Root-logger filter: False (drop) for a record carrying an :class:`UnsafeMetadataError`."""
    return not (record.exc_info and isinstance(record.exc_info[1], UnsafeMetadataError))


def tiling_problems(size: tuple, chunks) -> list[str]:
    """What is wrong with ``chunks`` as a partition of a tensor of ``size`` (empty: nothing).

    O(n log n) in the n chunks: after the bounds and the element count (equal volumes: any
    overlap leaves a gap too, so an overlap is all that is left to find), the dims every chunk
    spans whole are dropped (they cannot separate two chunks); with one dim left the chunks are
    its sorted ranges, each starting where the one before ends; with more, a sweep along the
    dim of most distinct offsets keeps the chunks it crosses ordered along a second (disjoint
    there when two dims are left: a new chunk is compared with its two neighbours only; with
    three or more, with those it crosses along the second dim).
    """
    boxes = []
    for chunk in chunks:
        off, ext = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(off) != len(size) or len(ext) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(off, ext, size)):
            return [f"the chunk at {off} of size {ext} lies outside the tensor's {size}"]
        if math.prod(ext):
            boxes.append((off, ext))
    total = sum(math.prod(e) for _, e in boxes)
    if total != math.prod(size):
        return [f"its chunks hold {total} elements, the tensor {math.prod(size)} ({size})"]
    found = _overlap(size, boxes)
    return [] if found is None else [f"the chunks at {found[0]} and {found[1]} overlap"]


def _overlap(size: tuple, boxes: list) -> Optional[tuple]:
    """The offsets of two overlapping boxes ``(offsets, sizes)`` inside ``size``, or None."""
    split = [d for d in range(len(size))
             if any(o[d] != 0 or e[d] != size[d] for o, e in boxes)]
    if len(boxes) > 1 and not split:
        return boxes[0][0], boxes[1][0]
    if len(split) <= 1:
        # one dim separates them: sorted ranges, each starting at or after the last one's end
        d = split[0] if split else 0
        ordered = sorted(boxes, key=lambda b: b[0][d])
        for (o, e), (nxt, _) in zip(ordered, ordered[1:]):
            if nxt[d] < o[d] + e[d]:
                return o, nxt
        return None
    # sweep along the dim of most distinct offsets: the fewest chunks cross each position
    split.sort(key=lambda d: -len({o[d] for o, _ in boxes}))
    a, b, others = split[0], split[1], split[2:]
    ordered = sorted(boxes, key=lambda x: x[0][a])
    ending: list = []  # heap of (end along a, key) of the chunks the sweep crosses
    active: list = []  # their keys (start along b, end along b, index), sorted
    for i, (off, ext) in enumerate(ordered):
        while ending and ending[0][0] <= off[a]:
            active.pop(bisect.bisect_left(active, heapq.heappop(ending)[1]))
        lo, hi = off[b], off[b] + ext[b]
        at = bisect.bisect_left(active, (lo,))
        # two dims: the active chunks are disjoint along b, so only the one before ``at`` and
        # the one at it can overlap [lo, hi); more dims: every one starting before hi
        candidates = active[max(at - 1, 0):at + 1] if not others else [
            k for k in active[:bisect.bisect_left(active, (hi,))] if k[1] > lo]
        for start, stop, j in candidates:
            o, e = ordered[j]
            if start < hi and lo < stop and all(
                    off[d] < o[d] + e[d] and o[d] < off[d] + ext[d] for d in others):
                return o, off
        key = (lo, hi, i)
        bisect.insort(active, key)
        heapq.heappush(ending, (off[a] + ext[a], key))
    return None
