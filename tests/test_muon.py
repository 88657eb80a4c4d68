"""gtp.muon on 2 gloo processes: a GTP-sharded weight's Muon update equals megatron's update of
the same logical (unpadded, unsharded) matrix, q/k/v split included; megatron-core 0.19.2's own
``TensorParallelMuon.orthogonalize`` (the patch taken out) fails that comparison by the padded
shape's scale factor.

The golden is megatron's unpatched path for a weight without GTP (what a ``gtp=off`` run does),
computed on every rank from the whole logical matrix; the patched path sees only this rank's
padded shard.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

COLS = 24
# (rows, pad_length, is_qkv): 30 rows padded to 32 (16-row shards); a linear_qkv of 2 query
# groups of q 8, k 4, v 4 rows padded to 36 (18-row shards: no shard holds whole groups).
CASES = [(30, 2, False), (32, 4, True)]
QKV_SPLIT = [8, 4, 4]


def _muon(group):
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    pgs = types.SimpleNamespace(tp=None, expt_tp=None, gtp_remat=group, expt_gtp_remat=None)
    return TensorParallelMuon([torch.nn.Parameter(torch.zeros(2, 2))], split_qkv=True,
                              qkv_split_shapes=QKV_SPLIT, fp32_matmul_prec="highest",
                              is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                              pg_collection=pgs, tp_mode="duplicated")


def _param(shape, qkv, gtp_pad=None):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.is_qkv = qkv
    if gtp_pad is not None:
        p.is_gtp_weight_remat, p.pad_length = True, gtp_pad
    return p


def _worker(patched: bool):
    from gtp import muon

    (muon.install if patched else muon.uninstall)()
    group = torch.distributed.group.WORLD
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    opt = _muon(group)
    out = []
    for rows, pad, qkv in CASES:
        gen = torch.Generator().manual_seed(rows)
        logical = torch.randn(rows, COLS, generator=gen)
        padded = torch.nn.functional.pad(logical, (0, 0, 0, pad))
        shard_rows = padded.shape[0] // size
        shard = padded[rank * shard_rows:(rank + 1) * shard_rows].clone()
        with torch.no_grad():
            # megatron tags is_qkv on the shard's rows; gtp.muon.tag_qkv on the logical ones.
            shard_qkv = qkv and (patched or shard_rows % sum(QKV_SPLIT) == 0)
            mine = opt.orthogonalize(_param(shard.shape, shard_qkv, pad), shard)
            golden = opt.orthogonalize(_param(logical.shape, qkv), logical)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(gathered, mine.contiguous(), group=group)
        out.append((torch.cat(gathered), golden))
    muon.install()
    return out


@pytest.fixture(scope="module")
def results():
    return {patched: run_distributed(_worker, 2, patched, timeout=180)[0]
            for patched in (True, False)}


def _same_update(full: torch.Tensor, golden: torch.Tensor, rows: int) -> None:
    assert torch.count_nonzero(full[rows:]) == 0, "padding rows got an update"
    torch.testing.assert_close(full[:rows], golden, rtol=1e-5, atol=1e-6)


def test_gtp_shards_update_as_the_logical_matrix(results):
    for (full, golden), (rows, _, _) in zip(results[True], CASES):
        _same_update(full, golden, rows)


def test_megatron_0_19_2_scales_by_the_padded_shape(results):
    """The patch taken out: the comparison above fails (the scale fix is what passes it)."""
    (full, golden), (rows, pad, _) = results[False][0], CASES[0]
    with pytest.raises(AssertionError):
        _same_update(full, golden, rows)
    # spectral scale sqrt(max(1, rows / cols)): 32 padded rows instead of 30.
    ratio = float(full[:rows].norm() / golden.norm())
    assert ratio == pytest.approx(math.sqrt((rows + pad) / rows), rel=1e-4)
    # The q/k/v weight: megatron cannot split an 18-row shard and orthogonalizes it whole.
    (full, golden), (rows, _, _) = results[False][1], CASES[1]
    with pytest.raises(AssertionError):
        _same_update(full, golden, rows)


def test_install_refuses_other_megatron_versions(monkeypatch):
    import megatron.core

    from gtp import muon

    monkeypatch.setattr(muon, "_PATCHED", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="0.19.2"):
        muon.install()
