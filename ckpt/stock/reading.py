"""The logical tensors of any checkpoint (:func:`read_logical`; stock ones reconstructed).

Memory: :func:`read_logical` holds the whole checkpoint (stored and logical copies of the GTP
tensors) in the memory of one process (``gtp compare``). :func:`iter_logical` reads one logical
tensor at a time (the stored tensors of its key group: a stock gated weight's ``_w`` / ``_v``
halves with it), so a reader that drops each tensor before asking for the next holds about the
largest tensor: :func:`ckpt.stock.convert` (and so :func:`ckpt.stock.prepare_load`, on rank 0)
and :func:`ckpt.hf.hf_export.export` read so.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Mapping, Optional

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


def load_stored(path, metadata: Mapping, keys) -> dict:
    """``{key: whole stored tensor}`` of the stored ``keys`` of the iter dir ``path`` (one read
    request; ``metadata``: megatron's ``load_tensors_metadata`` of ``path``). Needs a
    ``torch.distributed`` group (:func:`ensure_dist`); reads on the calling rank only."""
    from megatron.core import dist_checkpointing

    # Copies: megatron's load puts the data into the request's ShardedTensors, which must not
    # keep it (``metadata`` lives as long as the reader).
    request = {k: copy.copy(metadata[k]) for k in keys}
    return dist_checkpointing.load(request, str(path), validate_access_integrity=False)


class LogicalReader:
    """The logical tensors of an analysed checkpoint, read one key at a time
    (:meth:`read`): one read request per key, or per stock GTP weight's stored group (its
    ``_w`` / ``_v`` halves), kept for the next key of the same group and dropped before any
    other read; the caller holds what it keeps of the returned tensors. Needs a
    ``torch.distributed`` group (:func:`ensure_dist`); reads on the calling rank only.

    Attributes:
        analysis: the checkpoint's :class:`Analysis`; metadata: megatron's
            ``load_tensors_metadata`` of it (``metadata[key].dtype``: a stored key's dtype).
    """

    def __init__(self, analysis: Analysis):
        from megatron.core import dist_checkpointing

        self.analysis = analysis
        self.metadata = dist_checkpointing.load_tensors_metadata(str(analysis.path))
        self._group_keys, self._group = None, {}

    def read(self, key: str):
        """The logical tensor of the analysed key ``key`` (as :func:`read_logical` gives it).

        Raises:
            StockCheckpointError: a reconstructed shape that differs from the analysis.
        """
        info = self.analysis.tensors[key]
        if not info.stock:
            self._group_keys, self._group = None, {}
            return load_stored(self.analysis.path, self.metadata, [key])[key]
        prefix = split_key(key)[0]
        stored = [prefix + info.base + suf for suf in ("", "_w", "_v")
                  if prefix + info.base + suf in self.metadata]
        if stored != self._group_keys:
            self._group_keys, self._group = None, {}  # dropped before the next read
            loaded = load_stored(self.analysis.path, self.metadata, stored)
            self._group = {k[len(prefix + info.base):]: loaded[k] for k in stored}
            self._group_keys = stored
        return _checked(info, _reconstruct(info, self._group))


def iter_logical(ckpt, layout=None, analysis: Optional[Analysis] = None,
                 keys: Optional[Iterable[str]] = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(key, logical tensor)`` of ``ckpt`` (or of its ``keys`` only), one at a time, in
    the order of ``analysis.tensors``: the same tensors as :func:`read_logical`, each read when
    it is asked for (:class:`LogicalReader`). Initializes a 1-process gloo group for the reads
    when ``torch.distributed`` is not initialized (removed when the iteration ends).

    Raises:
        StockCheckpointError: as :func:`analyze` and :meth:`LogicalReader.read`.
    """
    analysis = analysis or analyze(ckpt, layout)
    wanted = None if keys is None else set(keys)
    cleanup = ensure_dist()
    try:
        reader = LogicalReader(analysis)
        for key in analysis.tensors:
            if wanted is None or key in wanted:
                yield key, reader.read(key)
    finally:
        cleanup()


def _checked(info: TensorInfo, logical):
    if tuple(logical.shape) != tuple(info.logical_shape):
        raise StockCheckpointError(
            f"{info.key}: reconstructed shape {tuple(logical.shape)} != {info.logical_shape}")
    return logical


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
        out[key] = _checked(info, _reconstruct(info, group))
    return analysis, out
