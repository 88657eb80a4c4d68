"""Read a torch_dist checkpoint's ``.metadata`` without running code from the file.

DCP stores its metadata as a pickle, and a pickle can name any callable to run on load. This
reader allows only the classes such a file needs (DCP's metadata dataclasses, ``torch.Size``,
dtypes, a few builtins and containers); any other global is refused before it is imported or
called. :func:`install` routes every DCP metadata read through it. The data files' object items
are still read by DCP with ``torch.load``: a checkpoint from elsewhere remains trusted input.
"""

from __future__ import annotations

import io
import pickle
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


def read_metadata(path) -> object:
    """The unpickled ``<path>/.metadata`` (torch DCP's ``Metadata``).

    Raises:
        UnsafeMetadataError: the file names a global outside the allowed list.
        OSError, pickle.UnpicklingError, EOFError: a missing or torn file.
    """
    source = Path(path) / ".metadata"
    data = source.read_bytes()
    metadata = _RestrictedUnpickler(io.BytesIO(data), source).load()
    if getattr(metadata, "storage_meta", None) is None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    return metadata


def install() -> None:
    """Route torch DCP's ``FileSystemReader.read_metadata`` (which megatron's
    ``load_tensors_metadata``/``load_common_state_dict``/``load`` use) through the restricted
    reader, so no ``.metadata`` pickle runs code whatever reads it first. Idempotent."""
    from torch.distributed.checkpoint import FileSystemReader

    if getattr(FileSystemReader.read_metadata, "_restricted", False):
        return

    def read_metadata_restricted(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = _RestrictedUnpickler(io.BytesIO(path.read_bytes()), path).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    read_metadata_restricted._restricted = True
    FileSystemReader.read_metadata = read_metadata_restricted
