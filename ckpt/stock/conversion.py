"""Write any checkpoint as a logical one (:func:`convert`; stock GTP weights reconstructed)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

from ckpt.format.records import megatron_core_version
from ckpt.stock.format import FORMAT_LOGICAL, SHARDING_RECORD_KEY, TRACKER, StockCheckpointError
from ckpt.format import dcp_writer
from ckpt.stock.analysis import analyze
from ckpt.stock.reading import LogicalReader, ensure_dist
from ckpt.stock.specs import Analysis, SavedLayout, get_path

# Common-state key of a converted checkpoint: where it came from.
CONVERTED_KEY = "gtp_converted_from"
CONVERTER_VERSION = 1
# The record's "converted_by": the package's name before it was ckpt.stock, kept so that the
# conversions cached before the rename stay valid (ckpt.stock.loading compares it).
CONVERTED_BY = f"gtp.legacy v{CONVERTER_VERSION}"


def fingerprint(path: Path) -> dict:
    st = (path / ".metadata").stat()
    return {"source": str(path.resolve()), "metadata_size": st.st_size,
            "metadata_mtime_ns": st.st_mtime_ns}


def _expert_saved_layout(analysis: Analysis) -> dict:
    """The routed experts' saving layout, for a checkpoint with expert GTP weights ({} else);
    its ``pad_for_alignment`` (one value for dense and expert GTP) is the one of whichever was
    sharded."""
    lay = analysis.expert_layout
    if lay is None:
        return {}
    return {"expert_tensor_parallel_size": lay.tp, "expert_gtp_remat_size": lay.g,
            "pad_for_alignment": lay.pad_for_alignment if lay.g > 1
            else analysis.layout.pad_for_alignment if analysis.layout else 0}


def _converted_common(analysis: Analysis) -> dict:
    common = copy.deepcopy(analysis.common)
    lay = analysis.layout or SavedLayout(
        int(get_path(common, "layout", "tensor_model_parallel_size") or 1), 1, 0)
    orig_layout = common.get("layout")
    if isinstance(orig_layout, dict):
        new = dict(orig_layout)
        g = int(new.get("gtp_remat_size", 1) or 1)
        new["gtp_remat_size"] = 1
        if new.get("expert_gtp_remat_size") is not None:
            new["expert_gtp_remat_size"] = 1  # (the expert data-parallel size is derived)
        new.pop("pad_for_alignment", None)  # the sharding record below owns it
        if new.get("data_parallel_size") is not None:
            new["data_parallel_size"] = int(new["data_parallel_size"]) * g
        common["layout"] = new
    common[SHARDING_RECORD_KEY] = {
        "gtp_format": FORMAT_LOGICAL, "tp": lay.tp, "gtp_remat_size": 1, "pad_for_alignment": 0,
        "megatron_core": megatron_core_version(), "tensors": {},
    }
    common[CONVERTED_KEY] = {
        "converted_by": CONVERTED_BY,
        "saved_layout": {"tensor_model_parallel_size": lay.tp, "gtp_remat_size": lay.g,
                         "pad_for_alignment": lay.pad_for_alignment,
                         **_expert_saved_layout(analysis)},
        "layout_source": analysis.layout_source,
        "layout": orig_layout,
        SHARDING_RECORD_KEY: analysis.common.get(SHARDING_RECORD_KEY),
        # stored under its old name: records of older conversions read alike
        "legacy_keys": sorted(k for k, i in analysis.tensors.items() if i.stock),
        **fingerprint(analysis.path),
    }
    return common


def broadcast_object(obj):
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# Sharded objects not carried into a converted checkpoint: the common state is rewritten, and
# per-rank RNG states belong to the ranks of the saving layout.
_DROPPED_OBJECTS = ("common_state", "rng_state")


def _read_objects(path: Path) -> list:
    """Every ShardedObject of the checkpoint but :data:`_DROPPED_OBJECTS` (e.g. the linear
    layers' ``_extra_state``), with its data; this rank reads them all (no collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    meta = TorchDistLoadShardedStrategy().load_sharded_metadata(path)
    state = {
        uk: ShardedObject(o.key, None, o.global_shape, o.global_offset, replica_id=0)
        for uk, o in meta.items()
        if isinstance(o, ShardedObject) and o.key not in _DROPPED_OBJECTS
    }
    if not state:
        return []
    loaded = dist_checkpointing.load(state, str(path), validate_access_integrity=False)
    return [(o.key, o.global_shape, o.global_offset, loaded[uk]) for uk, o in state.items()]


def _write(dst_iter: Path, analysis: Analysis, common: dict, objects=()) -> None:
    """Write the logical checkpoint of ``analysis`` into ``dst_iter`` from this rank alone, one
    tensor at a time (:mod:`ckpt.format.dcp_writer`; each read when the writer asks for it:
    :class:`ckpt.stock.reading.LogicalReader`): one unfragmented chunk per tensor, the common
    state ``common`` and the sharded ``objects``."""
    reader = LogicalReader(analysis)
    tensors = []
    for key, info in analysis.tensors.items():
        shape = tuple(int(d) for d in info.logical_shape)
        tensors.append((key, (0,) * len(shape), shape, shape, reader.metadata[key].dtype,
                        lambda key=key: reader.read(key).contiguous()))

    objects = [(key, offset, shape, data) for key, shape, offset, data in objects]
    dcp_writer.write(dst_iter, tensors, common, objects, label="convert",
                     errors=(StockCheckpointError,))


def _tracked(root: Path):
    """The iteration ``root``'s tracker names, or None (no or unreadable tracker)."""
    try:
        return int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def convert(src, dst_root, layout=None) -> Path:
    """Write ``src`` (any checkpoint; stock GTP weights reconstructed) as a logical checkpoint.

    The result is a normal torch_dist checkpoint under ``dst_root`` (``iter_XXXXXXX`` and
    ``latest_checkpointed_iteration.txt``) that stock megatron-core loads at any TP without GTP,
    and gtp-recipes loads at any layout. Its common state is the source's, with ``layout``
    rewritten to the non-GTP layout of the same TP (``gtp_remat_size`` 1, pad 0), a
    sharding record tagged ``logical-v1``, and ``gtp_converted_from`` (source path,
    original layout and its source, stock keys). Per-rank RNG states are not carried over.

    Collective when ``torch.distributed`` is initialized with several ranks (all call it; rank 0
    reads and writes the data); in one process it initializes a 1-process gloo group itself.

    Args:
        src: checkpoint root or iter dir.
        dst_root: output checkpoint root (created; an existing iter dir of the same iteration
            is replaced).
        layout: the saving layout when the checkpoint does not record it (:func:`parse_layout`).

    Returns:
        The written iter dir.

    Raises:
        StockCheckpointError: as :func:`analyze` (on every rank); ``dst_root`` is the source's
            dir, or its tracker names a newer iteration (it would move back).
    """
    import torch

    src_root = Path(src).resolve()
    if src_root.name.startswith("iter_"):
        src_root = src_root.parent
    if Path(dst_root).resolve() == src_root:
        raise StockCheckpointError(
            f"convert {src} {dst_root}: the destination is the source's checkpoint dir; write the "
            f"converted checkpoint to another dir")
    from mcore_compat import cpu as cpu_compat

    # Without CUDA, megatron's checkpoint writer needs the CPU shims (a no-op with CUDA or when
    # a training process installed them already).
    cpu_compat.install()
    cleanup = ensure_dist()
    try:
        rank = torch.distributed.get_rank()
        status, analysis, objects = None, None, ()
        if rank == 0:
            try:
                analysis = analyze(src, layout)
                objects = _read_objects(analysis.path)
                common = _converted_common(analysis)
                status = ("ok", common, int(common.get("iteration", 0) or 0))
            except StockCheckpointError as exc:
                status = ("error", str(exc), 0)
            except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
                status = ("error", f"cannot read {src}: {type(exc).__name__}: {exc}", 0)
        status = broadcast_object(status)
        if status[0] == "error":
            raise StockCheckpointError(status[1])
        common, iteration = status[1], status[2]
        dst_root = Path(dst_root)
        dst_iter = dst_root / f"iter_{iteration:07d}"
        tracked = _tracked(dst_root)
        if tracked is not None and tracked > iteration:
            raise StockCheckpointError(
                f"convert into {dst_root}: its {TRACKER} names iteration {tracked}, newer than the "
                f"converted {iteration}; writing would move it back: convert into another dir")
        # Written beside, renamed into place when complete: an existing save stays whole.
        staged = dst_root / f".{dst_iter.name}.staging"
        written = None
        if rank == 0:  # reads and writes alone; the others wait for its status
            try:
                dst_root.mkdir(parents=True, exist_ok=True)
                if staged.exists():
                    shutil.rmtree(staged)
                staged.mkdir()
                _write(staged, analysis, common, objects)
                written = ("ok", "")
            except StockCheckpointError as exc:
                written = ("error", str(exc))
            except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
                written = ("error", f"cannot read {src}: {type(exc).__name__}: {exc}")
        written = broadcast_object(written)
        if written[0] == "error":
            raise StockCheckpointError(written[1])
        if rank == 0:
            aside = dst_root / f".{dst_iter.name}.replaced"
            if dst_iter.exists():
                os.replace(dst_iter, aside)
            os.replace(staged, dst_iter)
            if aside.exists():
                shutil.rmtree(aside)
            tmp = dst_root / f".{TRACKER}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{iteration}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst_root / TRACKER)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        return dst_iter
    finally:
        cleanup()
