"""Row maps: for each logical row of a GTP weight, the stored row it is read from.

Stock megatron-core 0.19.2 writes every GTP-sharded weight in a padded, TP-shifted format
(``docs/checkpoint-format.md``; :func:`gtp.shards.stock_0192_offsets`): a column-parallel weight of
TP-local logical dim 0 ``L`` is stored with dim 0 ``tp*(L+pad)`` and every TP rank's rows
``tp_rank*pad`` late; a row-parallel one with ``L+pad`` rows (zero tail); a gated (SwiGLU) fc1 has
its gate/up halves mislabelled whenever ``g > 1``. Upstream can read such a file only into the
exact layout that wrote it. The maps here reconstruct the **logical** tensors (what the non-GTP
model at the same TP writes; ``docs/stock-conversion.md``) with the row arithmetic of
:mod:`gtp.shards`.
"""

from __future__ import annotations

from typing import Mapping, Optional

from gtp.shards import GTPShard, logical_pieces, stock_0192_offsets
from ckpt.stock.specs import SavedLayout, TensorSpec


def row_map(spec: TensorSpec, lay: SavedLayout, L: Optional[int] = None):
    """``({out_suffix: [(src_suffix, src_row) per logical row]}, {src_suffix: stored rows})``.

    Raises:
        ValueError: the layout cannot hold this L (e.g. pad 0 with L % g != 0, odd gated shard).
    """
    L = spec.L if L is None else L
    tp_ranks = range(lay.tp) if spec.tp_axis == 0 else (0,)  # row-parallel: rows same on all TP
    out: dict[str, list] = {}
    stored_rows: dict[str, int] = {}
    for k in tp_ranks:
        for r in range(lay.g):
            tl = GTPShard(L=L, tp=lay.tp, tp_rank=k, g=lay.g, gtp_rank=r,
                          pad_for_alignment=lay.pad_for_alignment, tp_axis=spec.tp_axis,
                          gated=spec.gated, singleton_local_shards=spec.singleton_local_shards)
            # where each padded shard row sits on disk
            src = [None] * tl.shard_rows
            for p in stock_0192_offsets(tl):
                stored_rows.setdefault(p.key_suffix, p.global_size)
                if stored_rows[p.key_suffix] != p.global_size:
                    raise ValueError(f"inconsistent stock sizes for {spec.key}{p.key_suffix}")
                for i in range(p.rows):
                    src[p.lo + i] = (p.key_suffix, p.global_offset + i)
            for p in logical_pieces(tl):
                rows = out.setdefault(p.key_suffix, [None] * p.global_size)
                for i in range(p.rows):
                    if rows[p.global_offset + i] is not None:
                        raise ValueError(f"logical row {p.global_offset + i} written twice")
                    rows[p.global_offset + i] = src[p.lo + i]
    for suffix, rows in out.items():
        if any(x is None for x in rows):
            raise ValueError(f"{spec.key}{suffix}: logical rows not covered")
    return out, stored_rows


def expected_stored_rows(spec: TensorSpec, lay: SavedLayout, L: int) -> dict:
    """{suffix: stored dim 0} of this GTP weight under ``lay`` (stock 0.19.2; g=1: logical).

    Raises:
        ValueError: the layout cannot hold this L.
    """
    tl = GTPShard(L=L, tp=lay.tp, tp_rank=0, g=lay.g, gtp_rank=0,
                  pad_for_alignment=lay.pad_for_alignment, tp_axis=spec.tp_axis,
                  gated=spec.gated, singleton_local_shards=spec.singleton_local_shards)
    return {p.key_suffix: p.global_size for p in stock_0192_offsets(tl)}


def candidate_Ls(spec: TensorSpec, lay: SavedLayout, stored: Mapping[str, int]) -> list[int]:
    """Every L that gives the stored dim 0 under ``lay`` (for a weight of unknown size)."""
    total = max(stored.values())
    if spec.tp_axis == 1:
        hi = total
    elif spec.gated and spec.singleton_local_shards:
        hi = 2 * total // lay.tp
    else:
        hi = total // lay.tp
    found = []
    for L in range(max(hi - lay.pad_for_alignment * lay.g, 1), hi + 1):
        if spec.gated and L % 2:
            continue
        try:
            if expected_stored_rows(spec, lay, L) == dict(stored):
                found.append(L)
        except ValueError:
            continue
    return found


def is_identity(rowmap) -> bool:
    for suffix, rows in rowmap.items():
        if any(src != (suffix, i) for i, src in enumerate(rows)):
            return False
    return True
