"""Read a torch_dist checkpoint's ``.metadata`` without running code from the file.

DCP stores its metadata as a pickle, and a pickle can name any callable to run on load. This
reader allows only the classes such a file needs (DCP's metadata dataclasses, ``torch.Size``,
dtypes, a few builtins and containers); any other global is refused before it is imported or
called. :func:`install` routes every DCP metadata read through it. The data files' object items
are unpickled with ``torch.load(weights_only=True)`` once :func:`gtp.safe_objects.install` ran
(which also runs this module's :func:`install`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import threading
from pathlib import Path

import torch

# Whole modules whose classes are plain data holders.
_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._extension",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.mapping",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("datetime", "timedelta"),
}


class UnsafeMetadataError(ValueError):
    """A ``.metadata`` file names a global outside the allowed list."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES or dtype:
            return super().find_class(module, name)
        raise UnsafeMetadataError(
            f"{self.source} names {module}.{name}, which a checkpoint's metadata never needs: "
            f"refusing to load it (a crafted or foreign file)")


# Per thread, within reused(): ``_THREAD.cache`` maps (device, inode, size, mtime) of a
# .metadata file to its unpickled Metadata (None outside any block).
_THREAD = threading.local()


@contextlib.contextmanager
def reused():
    """Within the block (or the function it decorates), each ``.metadata`` file is unpickled
    once: a later read of the same unchanged file (same device, inode, size and modification
    time) gets a copy of the first read's ``Metadata``.

    One checkpoint load (``recipes.checkpoint.load_checkpoint``) reads a file's metadata six
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
        UnsafeMetadataError: the file names a global outside the allowed list.
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
