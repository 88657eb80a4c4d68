"""DCP read requests for tests/test_dcp_reader.py and tests/test_dcp_reader_integrity.py:
independent goldens saved with plain torch, a planner that hands out sentinel-filled targets,
a ``FileSystemReader`` whose data streams count or alter the bytes read, and one read through
the project's reader or torch's own."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckpt.format import dcp_reader

SENTINEL = -7


def stored():
    """Independent goldens: what is saved, built with plain torch."""
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(96, 40, generator=g),
        "bf16": torch.randn(1, 1, 64, 24, generator=g).to(torch.bfloat16),
        "int64": torch.arange(50, dtype=torch.int64),
        "fp32_3d": torch.randn(4, 10, 8, generator=g),  # e.g. experts x rows x cols
        # Saved as a strided view of a (40, 96) storage: not a run of rows; torch reads it.
        "transposed": torch.randn(40, 96, generator=g).t(),
        "bytes": io.BytesIO(b"not a tensor"),
    }



class Planner:
    """resolve_tensor hands out sentinel-filled targets; commit_tensor records them."""

    def __init__(self, targets):
        self.targets, self.committed = targets, {}

    def resolve_tensor(self, item):
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item, tensor):
        self.committed[item.dest_index.fqn] = tensor

    def load_bytes(self, item, value):
        self.committed[item.dest_index.fqn] = torch.load(value, weights_only=False).getvalue()


def read_item(fqn, offsets, lengths, kind=LoadItemType.TENSOR):
    zero = torch.Size([0] * len(offsets))
    index = MetadataIndex(fqn, None if kind == LoadItemType.BYTE_IO else zero)
    return ReadItem(type=kind, dest_index=index, dest_offsets=zero,
                    storage_index=index, storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths))


class HookedStream(io.RawIOBase):
    """A data file's stream whose ``readinto`` goes through ``hook(inner_readinto, buffer)``."""

    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, *a):
        return self.inner.seek(*a)

    def tell(self):
        return self.inner.tell()

    def readinto(self, b):
        return self.hook(self.inner.readinto, b)


def file_reader(path, counter=None, hook=None):
    """A FileSystemReader of ``path``; ``counter``: counts the bytes read from the data files;
    ``hook``: wraps each data file stream's ``readinto`` (see :class:`HookedStream`)."""
    reader = FileSystemReader(str(path))
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    if counter is not None:
        def counting(readinto, b):
            n = readinto(b)
            counter[0] += n
            return n
        hook = counting
    if hook is not None:
        create_stream = reader.fs.create_stream

        class Wrapped:
            def __init__(self, *a):
                self.cm = create_stream(*a)

            def __enter__(self):
                return io.BufferedReader(HookedStream(self.cm.__enter__(), hook), buffer_size=512)

            def __exit__(self, *exc):
                return self.cm.__exit__(*exc)

        reader.fs.create_stream = Wrapped
    return reader


def torch_read_data():
    """torch's own ``FileSystemReader.read_data``, whether or not an earlier test (or a load in
    this process) installed the project's reader."""
    read_data = FileSystemReader.read_data
    return getattr(read_data, "stock", read_data)


def read(path, items, targets, runs, counter=None):
    reader = file_reader(path, counter)
    planner = Planner(targets)
    plan = LoadPlan(items)
    stock = torch_read_data()
    if runs:
        dcp_reader.read_data(reader, plan, planner, stock).wait()
    else:
        stock(reader, plan, planner).wait()
    return planner.committed
