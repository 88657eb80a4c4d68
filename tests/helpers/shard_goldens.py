"""Hand-made goldens for gtp/shards.py tests (tests/test_shards.py, tests/test_shards_property.py):
TP-local tensors sliced and GTP-sharded by hand with torch (each row holds its own index), a
stand-in process group for megatron's GTP helpers, and reassembly through a pieces function.
Nothing here goes through ``gtp.shards`` except the ``GTPShard`` layout record and ``Piece``."""

from __future__ import annotations

import contextlib
import warnings

import torch

from gtp.shards import GTPShard, Piece

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as mgtp
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

SENTINEL = -999.0
COLS = 3  # local dim 1 of every test weight


class Group:
    """Stand-in for a process group: megatron's GTP helpers only call size() and rank()."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@contextlib.contextmanager
def megatron_pad(a: int):
    old = mgtp.GTP_CONFIG.pad_for_alignment
    mgtp.GTP_CONFIG.pad_for_alignment = a
    try:
        yield
    finally:
        mgtp.GTP_CONFIG.pad_for_alignment = old


def hand_shards(tp_local: torch.Tensor, g: int, a: int) -> list[torch.Tensor]:
    """Pad the tail of dim 0 to a multiple of a*g and cut it in g equal slices (by hand)."""
    L = tp_local.shape[0]
    if a > 0:
        P = -(-L // (a * g)) * (a * g)
    else:
        assert L % g == 0
        P = L
    padded = torch.zeros((P, *tp_local.shape[1:]), dtype=tp_local.dtype)
    padded[:L] = tp_local
    s = P // g
    return [padded[r * s:(r + 1) * s].clone() for r in range(g)]


def write_piece(out: dict, counts: dict, key: str, piece: Piece, rows: torch.Tensor, col0: int = 0):
    """Place ``rows`` (piece.rows x cols) at the piece's global offset of ``out[key]``."""
    cols = rows.shape[1]
    out[key][piece.global_offset:piece.global_offset + piece.rows, col0:col0 + cols] = rows
    counts[key][piece.global_offset:piece.global_offset + piece.rows, col0:col0 + cols] += 1




def non_gtp_disk(lay: GTPShard) -> dict[str, torch.Tensor]:
    """On-disk tensors of the non-GTP model at the same TP, row i (per key) holding i."""
    if lay.gated and lay.singleton_local_shards:
        n = lay.tp * lay.L // 2
        return {k: torch.arange(n, dtype=torch.float32)[:, None].repeat(1, COLS) + off
                for k, off in (("w_w", 0.0), ("w_v", 0.5))}
    cols = COLS * lay.tp if lay.tp_axis == 1 else COLS
    rows = lay.L if lay.tp_axis == 1 else lay.L * lay.tp
    disk = torch.arange(rows, dtype=torch.float32)[:, None].repeat(1, cols)
    disk += torch.arange(cols, dtype=torch.float32)[None, :] / 100
    return {"w": disk}


def tp_local(disk: dict[str, torch.Tensor], lay: GTPShard, k: int) -> torch.Tensor:
    """The TP-local weight of TP rank k, sliced by hand from the non-GTP on-disk tensors."""
    L, tp = lay.L, lay.tp
    if lay.tp_axis == 1:
        return disk["w"][:, k * COLS:(k + 1) * COLS]
    if not lay.gated:
        return disk["w"][k * L:(k + 1) * L]
    h = L // 2
    if lay.singleton_local_shards:
        return torch.cat([disk["w_w"][k * h:(k + 1) * h], disk["w_v"][k * h:(k + 1) * h]])
    return torch.cat([disk["w"][k * h:(k + 1) * h], disk["w"][tp * h + k * h:tp * h + (k + 1) * h]])


def assert_tp_local_is_megatron_layout(disk, lay):
    """Saving each hand-made TP-local tensor the non-GTP megatron way reproduces ``disk``."""
    out = {k: torch.full_like(v, SENTINEL) for k, v in disk.items()}
    for k in range(lay.tp):
        local = tp_local(disk, lay, k)
        sh = ShardedTensor.from_rank_offsets("w", local, (lay.tp_axis, k, lay.tp),
                                             replica_id=(0, 0, 0))
        shs = (apply_swiglu_sharded_factory(sh, (), lay.singleton_local_shards).build()
               if lay.gated else [sh])
        for s in shs:
            out[s.key][tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = (
                s.data)
    for key in disk:
        assert torch.equal(out[key], disk[key]), key


def reassemble(lay_kw: dict, disk: dict[str, torch.Tensor], pieces_fn) -> dict:
    """Shard every TP-local tensor by hand (pad + slice), place rows through ``pieces_fn``."""
    out = {k: torch.full_like(v, SENTINEL) for k, v in disk.items()}
    counts = {k: torch.zeros_like(v, dtype=torch.int32) for k, v in disk.items()}
    proto = GTPShard(**lay_kw)
    for k in range(proto.tp):
        shards = hand_shards(tp_local(disk, proto, k), proto.g, proto.pad_for_alignment)
        for r, shard in enumerate(shards):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **lay_kw)
            for p in pieces_fn(lay):
                key = "w" + p.key_suffix
                assert p.global_size == disk[key].shape[0]
                col0 = k * COLS if lay.tp_axis == 1 else 0
                write_piece(out, counts, key, p, shard[p.lo:p.hi], col0)
    return out, counts
