"""gtp/shards.py: GTP padding math, logical pieces, and what stock megatron-core 0.19.2 writes.

Ground truth is megatron itself wherever it runs on CPU without process groups:
``gtp_remat_shard_dim0`` and ``_gtp_slice_one_param`` (with a stand-in group object),
``ShardedTensor.from_rank_offsets`` and ``apply_swiglu_sharded_factory``. Goldens are built by
hand with torch slicing (each row holds its own index), never through ``gtp.shards``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gtp.shards import Piece, GTPShard, gtp_padding, logical_pieces, logical_rows
from gtp.shards import stock_0192_offsets

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as mgtp
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from shard_goldens import (
    COLS, SENTINEL, Group, assert_tp_local_is_megatron_layout, hand_shards, megatron_pad,
    non_gtp_disk, reassemble, tp_local, write_piece,
)


# --------------------------------------------------------------------------------------------
# Section 2: padding table


TABLE = [  # L, g, a, pad, shard, logical rows per rank
    (192, 4, 16, 0, 48, [48, 48, 48, 48]),
    (192, 4, 32, 64, 64, [64, 64, 64, 0]),
    (1152, 4, 128, 384, 384, [384, 384, 384, 0]),
    (776, 2, 16, 24, 400, [400, 376]),
    (10, 2, 3, 2, 6, [6, 4]),
    (108, 2, 16, 20, 64, [64, 44]),  # qkv of hidden 72 at tp2
]


@pytest.mark.parametrize("L,g,a,pad,shard,rows", TABLE)
def test_spec_table(L, g, a, pad, shard, rows):
    assert gtp_padding(L, g, a) == (pad, shard)
    ranges = [logical_rows(L, g, a, r) for r in range(g)]
    assert [stop - start for start, stop in ranges] == rows
    assert ranges[0][0] == 0 and ranges[-1][1] == L
    for r in range(g):
        rows_r = GTPShard(L, g=g, gtp_rank=r, pad_for_alignment=a)
        assert (rows_r.pad, rows_r.shard_rows, rows_r.n_logical) == (pad, shard, rows[r])
    # megatron agrees (it returns (shard, pad))
    with megatron_pad(a):
        assert mgtp.gtp_remat_shard_dim0(L, Group(g)) == (shard, pad)


def test_all_padding_rank_is_empty_at_end():
    assert logical_rows(192, 4, 32, 3) == (192, 192)
    assert logical_rows(1152, 4, 128, 3) == (1152, 1152)


def test_unpadded_not_divisible_raises_like_megatron():
    with pytest.raises(ValueError, match=r"L=10.*g=4"):
        gtp_padding(10, 4, 0)
    with megatron_pad(0), pytest.raises(AssertionError, match="dim0=10"):
        mgtp.gtp_remat_shard_dim0(10, Group(4))
    assert gtp_padding(12, 4, 0) == (0, 3)


@pytest.mark.parametrize("args", [(10, 2, -1), (0, 2, 1), (10, 0, 1), (10, 2, 1.5)])
def test_invalid_arguments(args):
    with pytest.raises((ValueError, TypeError)):
        gtp_padding(*args)


@pytest.mark.parametrize("kwargs", [
    dict(L=10, g=2, gtp_rank=2), dict(L=10, tp=2, tp_rank=2), dict(L=10, tp_axis=2),
    dict(L=10, tp_axis=1, gated=True), dict(L=9, gated=True), dict(L=10, g=4),
])
def test_invalid_layouts(kwargs):
    with pytest.raises(ValueError):
        GTPShard(**kwargs)


def test_hand_sharding_matches_megatron_slice():
    """The golden's hand-written sharding is what ``_gtp_slice_one_param`` does."""
    for L, g, a, *_ in TABLE[:5]:
        w = torch.arange(L * COLS, dtype=torch.float32).reshape(L, COLS)
        hand = hand_shards(w, g, a)
        with megatron_pad(a):
            for r in range(g):
                shard = mgtp._gtp_slice_one_param(torch.nn.Parameter(w.clone()), Group(g, r))
                assert torch.equal(shard.detach(), hand[r]), (L, g, a, r)


# --------------------------------------------------------------------------------------------
# Section 3: worked cases of the stock bug


def test_worked_case_tp2_g2_L10_a3():
    lay = GTPShard(10, tp=2, tp_rank=1, g=2, gtp_rank=0, pad_for_alignment=3)
    (p,) = logical_pieces(lay)
    assert (p.global_offset, p.global_offset + p.rows, p.global_size) == (10, 16, 20)
    (s,) = stock_0192_offsets(lay)
    assert (s.global_offset, s.global_offset + s.rows, s.global_size) == (12, 18, 24)
    assert s.allow_shape_mismatch and not p.allow_shape_mismatch
    # tp=1, gtp=1: logical 16..19; stock reads 18..23 of which 20..23 lie past the 20 rows
    lay = GTPShard(10, tp=2, tp_rank=1, g=2, gtp_rank=1, pad_for_alignment=3)
    (p,) = logical_pieces(lay)
    (s,) = stock_0192_offsets(lay)
    assert (p.global_offset, p.rows) == (16, 4)
    assert (s.global_offset, s.rows) == (18, 6)


def _stock_read(ckpt: torch.Tensor, piece: Piece) -> torch.Tensor:
    """What loading with allow_shape_mismatch gives: stored rows, zeros past the data."""
    out = torch.zeros(piece.rows, *ckpt.shape[1:])
    avail = ckpt[piece.global_offset:piece.global_offset + piece.rows]
    out[:avail.shape[0]] = avail
    return out


def test_measured_cpu_case_hidden72_ffn200_tp2_g2_a16():
    """Spec section 3: fc1 TP-local L=100 (non-gated), tp2 x g2, a=16, pad 28, shard 64."""
    ckpt = torch.arange(200, dtype=torch.float32)[:, None].repeat(1, COLS)  # plain tp2 file
    assert gtp_padding(100, 2, 16) == (28, 64)
    stock_rows = {}
    logical_rows_read = {}
    for k in range(2):
        for r in range(2):
            lay = GTPShard(100, tp=2, tp_rank=k, g=2, gtp_rank=r, pad_for_alignment=16)
            (s,) = stock_0192_offsets(lay)
            assert s.global_size == 256
            stock_rows[k, r] = _stock_read(ckpt, s)[:, 0].tolist()
            (p,) = logical_pieces(lay)
            got = ckpt[p.global_offset:p.global_offset + p.rows][:, 0].tolist()
            logical_rows_read[k, r] = (got[0], got[-1], len(got))
    rng = lambda a, b: [float(i) for i in range(a, b)]  # noqa: E731
    assert stock_rows[0, 0] == rng(0, 64)
    assert stock_rows[0, 1] == rng(64, 128)  # 100..127 belong to tp1
    assert stock_rows[1, 0] == rng(128, 192)  # wants 100..163
    assert stock_rows[1, 1] == rng(192, 200) + [0.0] * 56  # wants 164..199
    assert logical_rows_read == {(0, 0): (0, 63, 64), (0, 1): (64, 99, 36),
                                 (1, 0): (100, 163, 64), (1, 1): (164, 199, 36)}


def test_measured_cpu_case_other_weights():
    # qkv: 3*72/2 = 108 rows per TP rank; linear_proj (row-parallel): out_features 72
    assert gtp_padding(108, 2, 16) == (20, 64)
    lay = GTPShard(72, tp=2, tp_rank=1, g=2, gtp_rank=1, pad_for_alignment=16, tp_axis=1)
    assert (lay.pad, lay.shard_rows, lay.logical) == (24, 48, (48, 72))
    assert logical_pieces(lay) == [Piece(0, 24, "", 48, 72)]
    assert stock_0192_offsets(lay) == [Piece(0, 48, "", 48, 96, "all", True)]


def test_stock_equals_logical_only_without_padding():
    for k in range(2):
        for r in range(2):
            lay = GTPShard(96, tp=2, tp_rank=k, g=2, gtp_rank=r, pad_for_alignment=16)
            assert lay.pad == 0
            (p,), (s,) = logical_pieces(lay), stock_0192_offsets(lay)
            assert (p.global_offset, p.rows, p.global_size) == (
                s.global_offset, s.rows, s.global_size)


# --------------------------------------------------------------------------------------------
# Stock offsets agree with megatron's own ShardedTensor construction


def _megatron_stock_shardings(lay: GTPShard, shard: torch.Tensor) -> list[ShardedTensor]:
    """Replay megatron 0.19.2's GTP branch of make_tp_sharded_tensor_for_checkpoint (+ SwiGLU)."""
    if lay.tp_axis == 0:
        offs = [(0, lay.tp_rank * lay.g + lay.gtp_rank, lay.tp * lay.g)]
    else:
        offs = [(1, lay.tp_rank, lay.tp), (0, lay.gtp_rank, lay.g)]
    sh = ShardedTensor.from_rank_offsets("w", shard, *offs, replica_id=(0, 0, 0),
                                         allow_shape_mismatch=lay.pad > 0)
    if not lay.gated:
        return [sh]
    return apply_swiglu_sharded_factory(sh, (), lay.singleton_local_shards).build()


def _ids(kw: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in kw.items())


LAYOUTS_FOR_MEGATRON = [
    dict(L=100, tp=2, g=2, pad_for_alignment=16),
    dict(L=72, tp=2, g=2, pad_for_alignment=16, tp_axis=1),
    dict(L=10, tp=2, g=2, pad_for_alignment=3, tp_axis=1),
    dict(L=200, tp=2, g=2, pad_for_alignment=16, gated=True),
    dict(L=200, tp=2, g=2, pad_for_alignment=16, gated=True, singleton_local_shards=True),
    dict(L=24, tp=1, g=4, pad_for_alignment=0, gated=True),
]


@pytest.mark.parametrize("kw", LAYOUTS_FOR_MEGATRON, ids=_ids)
def test_stock_offsets_match_megatron(kw):
    for k in range(kw["tp"]):
        for r in range(kw["g"]):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **kw)
            shard = torch.zeros(lay.shard_rows, COLS)
            mine = stock_0192_offsets(lay)
            theirs = _megatron_stock_shardings(lay, shard)
            assert len(mine) == len(theirs)
            for p, sh in zip(mine, theirs):
                assert sh.key == "w" + p.key_suffix
                assert sh.local_shape[0] == p.rows
                assert sh.global_shape[0] == p.global_size
                assert sh.global_offset[0] == p.global_offset
                assert sh.allow_shape_mismatch == p.allow_shape_mismatch
                if lay.tp_axis == 1:
                    assert sh.global_offset[1] == k * COLS and sh.global_shape[1] == lay.tp * COLS


def test_stock_gated_odd_shard_refused():
    with pytest.raises(ValueError, match="odd"):
        stock_0192_offsets(GTPShard(10, tp=1, g=2, pad_for_alignment=5, gated=True))


# --------------------------------------------------------------------------------------------
# Golden: every row holds its own index; reassemble through the pieces



GOLDEN_LAYOUTS = [
    dict(L=100, tp=2, g=2, pad_for_alignment=16),  # spec measured case (fc1, non-gated)
    dict(L=10, tp=2, g=2, pad_for_alignment=3),
    dict(L=192, tp=2, g=4, pad_for_alignment=32),  # all-padding rank
    dict(L=72, tp=2, g=2, pad_for_alignment=16, tp_axis=1),
    dict(L=192, tp=1, g=4, pad_for_alignment=32, tp_axis=1),
    dict(L=200, tp=2, g=2, pad_for_alignment=16, gated=True),  # fc1 of ffn 200 at tp2
    dict(L=200, tp=2, g=4, pad_for_alignment=16, gated=True),  # a shard straddles gate/up
    dict(L=24, tp=2, g=4, pad_for_alignment=0, gated=True),
    dict(L=20, tp=2, g=8, pad_for_alignment=4, gated=True),  # all-padding ranks, gated
    dict(L=200, tp=2, g=4, pad_for_alignment=16, gated=True, singleton_local_shards=True),
    dict(L=12, tp=4, g=3, pad_for_alignment=1, gated=True),
]


@pytest.mark.parametrize("kw", GOLDEN_LAYOUTS, ids=_ids)
def test_golden_logical_pieces_reproduce_non_gtp_disk(kw):
    proto = GTPShard(**kw)
    disk = non_gtp_disk(proto)
    assert_tp_local_is_megatron_layout(disk, proto)
    out, counts = reassemble(kw, disk, logical_pieces)
    for key in disk:
        assert torch.equal(out[key], disk[key]), key
        assert torch.all(counts[key] == 1), key


@pytest.mark.parametrize("kw", [kw for kw in GOLDEN_LAYOUTS if kw["pad_for_alignment"] > 1],
                         ids=_ids)
def test_golden_stock_layout_differs(kw):
    """Stock 0.19.2 offsets do not reproduce the non-GTP file (padded shape or scrambled rows)."""
    proto = GTPShard(**kw)
    disk = non_gtp_disk(proto)
    stock_disk = {}
    for k in range(proto.tp):
        shards = hand_shards(tp_local(disk, proto, k), proto.g, proto.pad_for_alignment)
        for r, shard in enumerate(shards):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **kw)
            for p in stock_0192_offsets(lay):
                key = "w" + p.key_suffix
                cols = shard.shape[1] * (lay.tp if lay.tp_axis == 1 else 1)
                t = stock_disk.setdefault(key, torch.full((p.global_size, cols), SENTINEL))
                col0 = k * COLS if lay.tp_axis == 1 else 0
                t[p.global_offset:p.global_offset + p.rows, col0:col0 + COLS] = shard[p.lo:p.hi]
    assert any(stock_disk[k].shape != disk[k].shape or not torch.equal(stock_disk[k], disk[k])
               for k in disk)
    # ... yet knowing the saving layout, the stock offsets suffice to recover the logical file
    recovered = {k: torch.full_like(v, SENTINEL) for k, v in disk.items()}
    counts = {k: torch.zeros_like(v, dtype=torch.int32) for k, v in disk.items()}
    for k in range(proto.tp):
        for r in range(proto.g):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **kw)
            shard = torch.empty(lay.shard_rows, COLS)
            col0 = k * COLS if lay.tp_axis == 1 else 0
            for p in stock_0192_offsets(lay):
                shard[p.lo:p.hi] = stock_disk["w" + p.key_suffix][
                    p.global_offset:p.global_offset + p.rows, col0:col0 + COLS]
            for p in logical_pieces(lay):
                write_piece(recovered, counts, "w" + p.key_suffix, p, shard[p.lo:p.hi], col0)
    for key in disk:
        assert torch.equal(recovered[key], disk[key]) and torch.all(counts[key] == 1)


def test_gated_stock_scrambles_even_without_padding():
    """tp1, g2, a=0, L=8 (h=4): rank 0 holds all 4 gate rows; stock files half of them as up."""
    kw = dict(L=8, tp=1, g=2, pad_for_alignment=0, gated=True)
    lay0 = GTPShard(gtp_rank=0, **kw)
    assert [(p.part, p.global_offset, p.rows) for p in logical_pieces(lay0)] == [("gate", 0, 4)]
    assert [(p.part, p.global_offset, p.rows) for p in stock_0192_offsets(lay0)] == [
        ("gate", 0, 2), ("up", 4, 2)]


def test_gated_straddling_shard_has_two_pieces():
    # L=200 (h=100), g=4, a=16: A=64, pad 56, s=64; rank 1 holds 64..127: gate 64..99, up 100..127
    lay = GTPShard(200, tp=2, tp_rank=1, g=4, gtp_rank=1, pad_for_alignment=16, gated=True)
    assert logical_pieces(lay) == [Piece(0, 36, "", 100 + 64, 400, "gate"),
                                   Piece(36, 64, "", 200 + 100 + 0, 400, "up")]
    lay = GTPShard(200, tp=2, tp_rank=1, g=4, gtp_rank=3, pad_for_alignment=16, gated=True)
    assert lay.n_logical == 8  # 192..199, up rows 92..99 of TP rank 1
    assert logical_pieces(lay) == [Piece(0, 8, "", 200 + 100 + 92, 400, "up")]


def test_empty_pieces_sit_at_the_end():
    """All-padding shards yield one empty piece at the end of the on-disk tensor (see module doc:
    an empty chunk at another chunk's start offset breaks the torch_dist save)."""
    lay = GTPShard(192, tp=2, tp_rank=0, g=4, gtp_rank=3, pad_for_alignment=32)
    assert logical_pieces(lay) == [Piece(0, 0, "", 384, 384)]
    lay = GTPShard(192, tp=2, tp_rank=0, g=4, gtp_rank=3, pad_for_alignment=32, tp_axis=1)
    assert logical_pieces(lay) == [Piece(0, 0, "", 192, 192)]
    lay = GTPShard(20, tp=2, g=8, gtp_rank=7, pad_for_alignment=4, gated=True)
    assert logical_pieces(lay) == [Piece(0, 0, "", 40, 40, "up")]
    lay = GTPShard(20, tp=2, g=8, gtp_rank=7, pad_for_alignment=4, gated=True,
                   singleton_local_shards=True)
    assert logical_pieces(lay) == [Piece(0, 0, "_v", 20, 20, "up")]
