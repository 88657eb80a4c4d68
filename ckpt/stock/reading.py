"""The logical tensors of any checkpoint (:func:`read_logical`; stock ones reconstructed).

Memory: :func:`read_logical` holds the whole checkpoint (stored and logical copies of the GTP
tensors) in the memory of one process; :func:`ckpt.stock.convert` and
:func:`ckpt.stock.prepare_load` do that on rank 0 only.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from gtp.progress import progress
from ckpt.stock.analysis import analyze
from ckpt.stock.format import StockCheckpointError
from ckpt.stock.specs import Analysis, TensorInfo, split_key, strip_suffix


def ensure_dist():
    """Init a 1-process gloo group when none exists; returns a cleanup callable."""
    import torch

    if torch.distributed.is_initialized():
        return lambda: None
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    return torch.distributed.destroy_process_group


def _reconstruct(info: TensorInfo, stored: Mapping[str, Any]):
    """The logical tensor of one stored key from the stored tensors of its base key group."""
    import torch

    out_suffix = strip_suffix(split_key(info.key)[1])[1]
    rows = info.rowmap[out_suffix]
    order = sorted({s for s, _ in rows})
    base_off, parts, off = {}, [], 0
    for s in order:
        t = stored[s]
        base_off[s] = off
        off += t.shape[-2]
        parts.append(t)
    src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    index = torch.tensor([base_off[s] + r for s, r in rows], dtype=torch.long)
    return torch.index_select(src, src.dim() - 2, index).contiguous()


def read_logical(ckpt, layout=None, analysis: Optional[Analysis] = None):
    """The logical tensors of ``ckpt``: ``(analysis, {key: tensor})``.

    Stock GTP weights (and their optimizer moments / fp32 copies, sharded like them) are
    reconstructed; every other tensor is returned as stored. Initializes a 1-process gloo group
    for the read when ``torch.distributed`` is not initialized (and removes it after). In a
    multi-process group this reads on the calling rank only (no collective).

    Raises:
        StockCheckpointError: as :func:`analyze`.
    """
    from megatron.core import dist_checkpointing

    analysis = analysis or analyze(ckpt, layout)
    cleanup = ensure_dist()
    try:
        stored = dist_checkpointing.load_plain_tensors(str(analysis.path))
    finally:
        cleanup()

    out = {}
    for key, info in progress(analysis.tensors.items(), "read", total=len(analysis.tensors),
                              unit="tensor"):
        if not info.stock:
            out[key] = stored[key]
            continue
        prefix, model_key = split_key(key)
        group = {}
        for suf in ("", "_w", "_v"):
            k = prefix + info.base + suf
            if k in stored:
                group[suf] = stored[k]
        logical = _reconstruct(info, group)
        if tuple(logical.shape) != tuple(info.logical_shape):
            raise StockCheckpointError(
                f"{key}: reconstructed shape {tuple(logical.shape)} != {info.logical_shape}")
        out[key] = logical
    return analysis, out
