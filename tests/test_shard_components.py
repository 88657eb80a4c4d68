"""gtp/shards.py: a GTP weight that packs several TP-sharded components (Mamba's ``in_proj``,
``z | x | B | C | dt``) in the logical format.

Ground truth: without GTP, megatron-core 0.19.2 stores such a weight through
``ssm.utils._split_tensor_factory`` (built here on a plain TP ``ShardedTensor``): component ``c``
of TP rank ``k`` under ``<key>.<c>`` at ``k * n_c`` of ``tp * n_c``. The goldens are built by hand
with torch slicing (each row holds its component and its row number), never through ``gtp.shards``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp.shards import GTPShard, gtp_padding, logical_pieces, stock_0192_offsets

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.ssm.utils import _split_tensor_factory

SENTINEL = -1.0
# The notes' MambaMixer: hidden 64, d_inner 128, 2 groups of state 16, 8 heads (TP-local at tp1).
MAMBA = (("z", 128), ("x", 128), ("B", 32), ("C", 32), ("dt", 8))


def _full(components, tp: int) -> dict[str, torch.Tensor]:
    """Each component's non-GTP on-disk tensor (tp * n rows), row ``i`` of component ``j``
    holding ``j * 10000 + i``."""
    return {name: j * 10000.0 + torch.arange(tp * n, dtype=torch.float64)
            for j, (name, n) in enumerate(components)}


def _tp_local(full, components, tp: int, k: int) -> torch.Tensor:
    """TP rank k's packed rows, by hand: component by component, its k-th chunk."""
    return torch.cat([full[name][k * n:(k + 1) * n] for name, n in components])


def _shard(t: torch.Tensor, g: int, a: int, r: int) -> torch.Tensor:
    """GTP rank r's padded shard of ``t``, by hand: zero tail to a multiple of a*g, r-th slice."""
    P = -(-t.shape[0] // (a * g)) * (a * g) if a else t.shape[0]  # a=0: g divides it
    padded = torch.zeros(P, dtype=t.dtype)
    padded[:t.shape[0]] = t
    s = P // g
    return padded[r * s:(r + 1) * s]


def _write_all(components, tp: int, g: int, a: int):
    """Every rank's pieces written into sentinel-filled per-key tensors; also counts writes.
    ``components``: ``((name, TP-local rows), ...)``; keys are ``.<name>``."""
    full = _full(components, tp)
    disk = {f".{name}": torch.full((tp * n,), SENTINEL, dtype=torch.float64)
            for name, n in components}
    writes = {key: torch.zeros(t.shape[0], dtype=torch.int64) for key, t in disk.items()}
    for k in range(tp):
        local = _tp_local(full, components, tp, k)
        for r in range(g):
            shard = _shard(local, g, a, r)
            rows = GTPShard(L=local.shape[0], tp=tp, tp_rank=k, g=g, gtp_rank=r,
                            pad_for_alignment=a, components=_components(components))
            assert rows.shard_rows == shard.shape[0]
            covered = 0
            for p in logical_pieces(rows):
                assert p.global_size == disk[p.key_suffix].shape[0]
                disk[p.key_suffix][p.global_offset:p.global_offset + p.rows] = shard[p.lo:p.hi]
                writes[p.key_suffix][p.global_offset:p.global_offset + p.rows] += 1
                covered += p.rows
            assert covered == rows.n_logical
    return full, disk, writes


def _components(names_sizes):
    return tuple((f".{name}", n) for name, n in names_sizes)


@pytest.mark.parametrize("tp,g,a", [(1, 2, 16), (1, 4, 32), (2, 2, 16), (2, 4, 32), (1, 3, 1),
                                    (4, 2, 8), (1, 1, 0)])
def test_pieces_write_every_component_row_once(tp, g, a):
    components = tuple((name, n // tp) for name, n in MAMBA)
    full, disk, writes = _write_all(components, tp, g, a)
    for name, _ in components:
        assert torch.equal(disk[f".{name}"], full[name]), name
        assert bool((writes[f".{name}"] == 1).all()), name


def test_non_gtp_pieces_are_what_megatron_split_factory_writes():
    """g=1: the pieces are exactly megatron's ``_split_tensor_factory`` ShardedTensors."""
    tp = 2
    components = tuple((name, n // tp) for name, n in MAMBA)
    L = sum(n for _, n in components)
    for k in range(tp):
        base = ShardedTensor.from_rank_offsets("w", torch.zeros(L, 3), (0, k, tp))
        factory = _split_tensor_factory(base, [n for _, n in components],
                                        [name for name, _ in components], 0)
        want = sorted((st.key, st.global_offset[0], st.local_shape[0], st.global_shape[0])
                      for st in factory.build())
        shard = GTPShard(L=L, tp=tp, tp_rank=k, components=_components(components))
        got = sorted(("w" + p.key_suffix, p.global_offset, p.rows, p.global_size)
                     for p in logical_pieces(shard))
        assert got == want


def test_seed_case_g2_a16_boundary_inside_x_padding_after_dt():
    """The notes' case: 328 rows at g2/a16 pad to 352; rank 0 holds z and x[0:48], rank 1
    x[48:128], B, C, dt and 24 padding rows."""
    components = _components(MAMBA)
    assert gtp_padding(328, 2, 16) == (24, 176)
    r0 = logical_pieces(GTPShard(L=328, g=2, gtp_rank=0, pad_for_alignment=16,
                                 components=components))
    r1 = logical_pieces(GTPShard(L=328, g=2, gtp_rank=1, pad_for_alignment=16,
                                 components=components))
    assert [(p.key_suffix, p.lo, p.hi, p.global_offset, p.global_size) for p in r0] == [
        (".z", 0, 128, 0, 128), (".x", 128, 176, 0, 128)]
    assert [(p.key_suffix, p.lo, p.hi, p.global_offset, p.global_size) for p in r1] == [
        (".x", 0, 80, 48, 128), (".B", 80, 112, 0, 32), (".C", 112, 144, 0, 32),
        (".dt", 144, 152, 0, 8)]


def test_all_padding_shard_is_one_empty_piece_at_the_end_of_the_last_component():
    """tp2: 164 rows per TP rank at g4/a32 pad to 256 (shards of 64): GTP rank 3 holds only
    padding."""
    components = _components((name, n // 2) for name, n in MAMBA)
    for k in range(2):
        pieces = logical_pieces(GTPShard(L=164, tp=2, tp_rank=k, g=4, gtp_rank=3,
                                         pad_for_alignment=32, components=components))
        assert [(p.key_suffix, p.lo, p.hi, p.global_offset, p.global_size) for p in pieces] == [
            (".dt", 0, 0, 8, 8)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(L=10, components=((".a", 4), (".b", 5))), "hold 9 rows"),
    (dict(L=10, tp_axis=1, components=((".a", 5), (".b", 5))), "column-parallel"),
    (dict(L=10, gated=True, components=((".a", 5), (".b", 5))), "column-parallel"),
    (dict(L=10, components=((".a", 10), (".b", 0))), "rows of component"),
    (dict(L=10, components=(".a", 10)), "pairs"),
])
def test_invalid_components(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GTPShard(**kwargs)


def test_stock_offsets_refuse_components():
    with pytest.raises(ValueError, match="packed components"):
        stock_0192_offsets(GTPShard(L=328, g=2, pad_for_alignment=16,
                                    components=_components(MAMBA)))


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), tp=st.integers(1, 3),
       g=st.integers(1, 5), a=st.integers(1, 40))
def test_prop_pieces_tile_each_component(sizes, tp, g, a):
    components = tuple((f"c{j}", n) for j, n in enumerate(sizes))
    full, disk, writes = _write_all(components, tp, g, a)
    for name, _ in components:
        assert torch.equal(disk[f".{name}"], full[name])
        assert bool((writes[f".{name}"] == 1).all())
