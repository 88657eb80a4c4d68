"""gtp/shards.py under hypothesis: padding and coverage, and pieces that tile the global tensor
and land where the non-GTP megatron layout puts each row, for random lengths, GTP sizes and
alignments (goldens by hand: tests/helpers/shard_goldens.py)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gtp.shards import GTPShard, gtp_padding, logical_pieces, logical_rows
from shard_goldens import Group, megatron_pad, mgtp, non_gtp_disk, reassemble


# --------------------------------------------------------------------------------------------
# Properties

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _lga(draw):
    g = draw(st.integers(1, 8))
    a = draw(st.integers(0, 128))
    if a == 0:
        L = g * draw(st.integers(1, 4096 // g))
    else:
        L = draw(st.integers(1, 4096))
    return L, g, a


@PROPS
@given(_lga())
def test_prop_padding_and_coverage(lga):
    L, g, a = lga
    pad, s = gtp_padding(L, g, a)
    assert g * s == L + pad
    if a == 0:
        assert pad == 0
    else:
        assert 0 <= pad < a * g and (L + pad) % (a * g) == 0
    prev = 0
    for r in range(g):
        start, stop = logical_rows(L, g, a, r)
        assert start == prev and start <= stop and stop - start <= s
        assert start == min(r * s, L)  # the prefix of padded rows [r*s, (r+1)*s)
        prev = stop
    assert prev == L
    with megatron_pad(a):
        assert mgtp.gtp_remat_shard_dim0(L, Group(g)) == (s, pad)


def _tiles(kw: dict) -> None:
    """Union of all pieces tiles each key's [0, global_rows) exactly once; local ranges are a
    disjoint cover of each shard's logical prefix; empty pieces sit at the end."""
    proto = GTPShard(**kw)
    intervals: dict[str, list[tuple[int, int]]] = {}
    for k in range(proto.tp):
        for r in range(proto.g):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **kw)
            pieces = logical_pieces(lay)
            assert pieces
            assert pieces[0].lo == 0 and pieces[-1].hi == lay.n_logical
            for a, b in zip(pieces, pieces[1:]):
                assert a.hi == b.lo and a.rows > 0 and b.rows > 0
            for p in pieces:
                assert p.global_size == lay.global_rows and not p.allow_shape_mismatch
                if p.rows == 0:
                    assert p.global_offset == p.global_size
                    continue
                # row-parallel: TP ranks tile dim 0 each in their own dim-1 column block
                block = (p.key_suffix, k if lay.tp_axis == 1 else None)
                intervals.setdefault(block, []).append(
                    (p.global_offset, p.global_offset + p.rows))
    keys = {"_w", "_v"} if proto.gated and proto.singleton_local_shards else {""}
    blocks = range(proto.tp) if proto.tp_axis == 1 else [None]
    assert set(intervals) == {(key, b) for key in keys for b in blocks}
    for key, ivs in intervals.items():
        ivs.sort()
        pos = 0
        for lo, hi in ivs:
            assert lo == pos, (key, ivs)
            pos = hi
        assert pos == proto.global_rows


@PROPS
@given(_lga(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 1]))
def test_prop_pieces_tile_global_tensor(lga, tp, tp_axis):
    L, g, a = lga
    _tiles(dict(L=L, tp=tp, g=g, pad_for_alignment=a, tp_axis=tp_axis))


@PROPS
@given(_lga(), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_prop_gated_pieces_tile_and_land_where_non_gtp_puts_them(lga, tp, singleton):
    L, g, a = lga
    L += L % 2
    assume(a > 0 or L % g == 0)
    kw = dict(L=L, tp=tp, g=g, pad_for_alignment=a, gated=True, singleton_local_shards=singleton)
    _tiles(kw)
    # every TP-local logical row x of TP rank k: non-GTP megatron puts gate row x (< h) at
    # k*h + x and up row x (>= h) at tp*h + k*h + x - h (singleton: key _v at k*h + x - h)
    h = L // 2
    for k in range(tp):
        for r in range(g):
            lay = GTPShard(tp_rank=k, gtp_rank=r, **kw)
            start, _ = lay.logical
            for p in logical_pieces(lay):
                for x in {start + p.lo, start + p.hi - 1} if p.rows else ():
                    if x < h:
                        assert p.part == "gate"
                        want = ("_w" if singleton else "", k * h + x)
                    else:
                        assert p.part == "up"
                        want = ("_v", k * h + x - h) if singleton else ("", tp * h + k * h + x - h)
                    assert (p.key_suffix, p.global_offset + (x - start - p.lo)) == want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 64), st.sampled_from([1, 2, 4]), st.integers(1, 6), st.integers(0, 9),
       st.sampled_from(["col", "row", "gated", "gated_singleton"]))
def test_prop_golden_torch(half, tp, g, a, kind):
    L = 2 * half if kind.startswith("gated") else half
    assume(a > 0 or L % g == 0)
    kw = dict(L=L, tp=tp, g=g, pad_for_alignment=a, tp_axis=1 if kind == "row" else 0,
              gated=kind.startswith("gated"), singleton_local_shards=kind == "gated_singleton")
    disk = non_gtp_disk(GTPShard(**kw))
    out, counts = reassemble(kw, disk, logical_pieces)
    for key in disk:
        assert torch.equal(out[key], disk[key]) and torch.all(counts[key] == 1)
