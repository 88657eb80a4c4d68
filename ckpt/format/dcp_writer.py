"""Write a torch_dist checkpoint in one process, each chunk made when the writer asks for it.

:func:`write` is what the offline tools that write checkpoints use (``gtp convert``, and
``gtp import``): no state dict of tensors exists, only write items and a producer per item
(a torch DCP ``SavePlanner`` whose ``resolve_data`` calls the producer), so the data held at
once is the chunk being written. torch's ``FileSystemWriter`` (torch 2.14,
``_write_files_from_queue``) keeps the last chunk of each key in a dict until its file is
written (for its safetensors format only); the planner frees the storage of each chunk when the
next is asked for, so that dict holds empty tensors instead of the whole checkpoint.

The files are those megatron's torch_dist save of one rank writes: ``__0_0.distcp`` (the
chunks, then the objects), ``.metadata`` and ``metadata.json``; the common state is the object
``common_state`` megatron stores it as, and each megatron ``ShardedObject`` the object
``<key>/shard_<offset>_<global shape>`` it stores one as.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Iterable

from gtp.progress import progress

# Producer of one chunk: returns the tensor (CPU, the item's chunk shape and dtype).
Producer = Callable[[], Any]


def _planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class _LazyPlanner(DefaultSavePlanner):
        """Plans the given write items; ``resolve_data`` makes each chunk when it is written
        and frees the storage of the one before."""

        def __init__(self, items, producers):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._items, self._producers, self._last = items, producers, None

        def create_local_plan(self):
            self.plan = SavePlan(self._items)
            return self.plan

        def resolve_data(self, write_item):
            self.release()
            data = self._producers[(write_item.index.fqn, tuple(write_item.index.offset or ()))]()
            if hasattr(data, "untyped_storage"):
                if not data.untyped_storage().resizable():  # e.g. a view of a file's bytes
                    data = data.clone()
                self._last = data
            return data

        def release(self) -> None:
            """Free the storage of the chunk resolved last (written by now: the writer asks
            for one chunk at a time and writes it before asking for the next)."""
            if self._last is not None:
                self._last.untyped_storage().resize_(0)
                self._last = None

    return _LazyPlanner


def tensor_item(fqn: str, offset: tuple, sizes: tuple, global_size: tuple, dtype):
    """torch DCP's write item of the chunk ``sizes`` at ``offset`` of the tensor ``fqn``
    (global shape ``global_size``, ``dtype``)."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype), size=torch.Size(global_size)))


def object_fqn(key: str, offset: tuple, global_shape: tuple) -> str:
    """The name megatron's torch_dist save gives the object ``ShardedObject(key, ...,
    global_shape, offset)`` (``ShardedObject.unique_key``)."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, global_shape))}"


def write(path, tensors: Iterable[tuple], common: dict, objects: Iterable[tuple] = (),
          label: str = "write", errors: tuple = ()) -> None:
    """Write the checkpoint files into the existing dir ``path``.

    Args:
        tensors: ``(fqn, offset, sizes, global_size, dtype, producer)`` per chunk; ``producer()``
            returns the chunk (a CPU tensor of ``sizes``, ``dtype``) when it is written.
        common: the common state (megatron's ``common_state`` object).
        objects: ``(key, offset, global_shape, data)`` per megatron ``ShardedObject``.
        label: the progress bar's label (:mod:`gtp.progress`; one step per item written).
        errors: exception types a producer raises that are raised as they are (torch DCP wraps
            them in a ``CheckpointException``).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    items, producers = [], {}
    for fqn, offset, sizes, global_size, dtype, producer in tensors:
        items.append(tensor_item(fqn, offset, sizes, global_size, dtype))
        producers[(fqn, tuple(offset))] = producer

    def byte_item(fqn: str, value) -> None:
        blob = io.BytesIO()
        torch.save(value, blob)
        items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        producers[(fqn, ())] = lambda: io.BytesIO(blob.getvalue())

    # megatron stores each object's data in a list (``_mcore_to_torch_sharded_object``).
    byte_item(object_fqn("common_state", (0,), (1,)), [common])
    for key, offset, global_shape, data in objects:
        byte_item(object_fqn(key, offset, global_shape), [data])
    planner = _planner_class()(items, _Progress(producers, label, len(items)))
    writer = dcp.FileSystemWriter(str(Path(path)), single_file_per_rank=True, thread_count=1,
                                  sync_files=True)
    try:
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as exc:  # a producer's error, wrapped by DCP: raise it as is
        for failure in getattr(exc, "failures", {}).values():
            cause = getattr(failure, "exc", failure)
            if errors and isinstance(cause, errors):
                raise cause from None
        raise
    finally:
        planner.release()
    save_config(CheckpointingConfig("torch_dist", 1), str(path))


class _Progress(dict):
    """The producers, advancing a progress bar as items are written."""

    def __init__(self, producers: dict, label: str, total: int):
        super().__init__(producers)
        self._bar = iter(progress(range(total), label, total=total, unit="item"))

    def __getitem__(self, key) -> Producer:
        next(self._bar, None)
        return super().__getitem__(key)
