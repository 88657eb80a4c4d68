"""gtp.backend (portable GTP weight remat over torch.distributed) and gtp.alignment.

Multi-process tests run a tiny GPTModel (local spec, fp32, CPU init, hidden 72, ffn 200, vocab
272) on 4 gloo ranks. Dims were chosen so that GTP padding is non-zero and, at g4/a32, a rank
holds only padding (linear_proj/linear_fc2: L=72 -> 32,32,8,0 rows; vocab: L=272 -> 96,96,80,0).
The vocab is a multiple of 8*tp for tp in {1, 2}, so megatron adds no vocab padding and every
layout computes over the same logits. The workers of that world are
tests/helpers/gtp_backend_world.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from gtp_backend_world import (
    LAYOUTS, MICRO_BATCHES, OVERLAP_LAYOUTS, STEPS, WORLD, all_workers, gtp_mod,
)
from multiproc import run_distributed
from tolerance import fp32_rtol


# fp32 tolerances for "GTP changes no math". Layouts differ only in the order of floating-point
# reductions: the GEMMs see the same gathered weight bit for bit (test_backend_is_what_ran), but
# a wgrad is summed over a different set of ranks (reduce-scatter over g, then the DP all-reduce
# over dp/g, instead of one all-reduce over dp, with the 1/g and 1/dp scalings applied at other
# points), TP=2 splits GEMM reductions and the vocab softmax, and the grad norm sums squares in
# another order. Each reduction adds a relative error of a few fp32 ulps (~1e-7).
# - loss (~5.6, fp32 ulp 4.8e-7): measured max diff 0 -> 1e-5 (~20 ulp).
# - grad norm (~0.8): measured max relative diff 4e-7; bound tolerance.fp32_rtol(STEPS) (the
#   largest of the steps' bounds, tests/helpers/tolerance.py).
# - weights after 3 Adam steps: Adam's update is lr * m/sqrt(v), so a gradient's relative error
#   enters the update unamplified, except where an element's grads nearly cancel across steps
#   (m ~ 0): there a 1e-7 relative error in g moves the update by a visible fraction of lr.
#   Measured: GTP vs g=1 at the same TP <= 3.8e-6 -> 1e-5; tp2 vs tp1 3.6e-5 (0.036 lr, the same
#   with and without GTP: it comes from TP's split GEMMs) -> 1e-4 = 0.1 lr. Adam is invariant to
#   a uniform gradient scale, so the grad-norm check is the one that catches a wrong 1/g factor.
LOSS_ATOL = 1e-5
GRAD_NORM_RTOL = fp32_rtol(STEPS)
WEIGHT_ATOL_SAME_TP = 1e-5
WEIGHT_ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# Multi-process tests (one shared 4-rank run).
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world_results():
    results = run_distributed(all_workers, WORLD, timeout=300)
    assert len(results) == WORLD
    return results


def _max_weight_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiprocess
def test_backend_is_what_ran(world_results):
    assert len(world_results) == WORLD
    results = [r["backend"] for r in world_results]
    for layout in [(1, 2, 16), (1, 4, 32), (2, 2, 16)]:
        for r in (r[layout] for r in results):
            assert r["checked"] == r["n_gtp"] > 0, (layout, r)
            # forward: one all-gather per GTP weight; backward: one per weight except the
            # embedding (its wgrad needs no weight); one reduce-scatter per weight.
            assert r["counts"] == {"ag": 2 * r["n_gtp"] - 1, "rs": r["n_gtp"]}, (layout, r)
            assert r["grads_nonzero"] and r["pad_grad_max"] == 0.0, (layout, r)
            assert r["ckpt_rows"] == r["proj_padded_rows"], (layout, r)
            assert r["mismatch_errors"] == 3, (layout, r)
    # g4/a32 leaves the last GTP rank with nothing but padding in linear_proj, linear_fc2
    # (L=72 -> 32,32,8,0) and the vocab tensors (L=272 -> 96,96,80,0).
    assert sum(r[(1, 4, 32)]["empty_shards"] for r in results) > 0


@pytest.mark.multiprocess
def test_gloo_gather_and_reduce_scatter_equal_their_goldens(world_results):
    """On gloo, GTP's all-gather and reduce-scatter are point-to-point exchanges
    (gtp.backend._peer_all_gather / _peer_reduce_scatter); each equals, bit for bit, a golden
    built from every rank's known input: gathered shards concatenated in group-rank order, and
    the reduce-scatter's rows summed in group-rank order, also into rows of its own input.
    Buffers an exchange cannot fill raise ValueError before anything is sent, and the group's
    next exchange is exact."""
    for rank, r in enumerate(w["peer_exchange"] for w in world_results):
        groups = ["2", "4", "1,3"] if rank in (1, 3) else ["2", "4"]
        assert r["peer"] == {name: True for name in groups}, rank
        assert len(r["ok"]) == len(groups) * 2 * 2 * 4, rank
        for case, gather_ok, reduce_ok in r["ok"]:
            assert gather_ok and reduce_ok, (rank, case, gather_ok, reduce_ok)
        assert r["aliased"], rank
        assert len(r["refused"]) == 4 and all(ok for _, _, ok in r["refused"]), r["refused"]
        assert r["after_refusals"], rank


@pytest.mark.multiprocess
def test_loss_grad_norm_and_weights_match_across_layouts(world_results):
    assert len(world_results) == WORLD
    results = [r["invariance"] for r in world_results]
    rank0 = results[0]
    ref = rank0[LAYOUTS[0]]
    lines = []
    for layout in LAYOUTS[1:]:
        got = rank0[layout]
        loss_diff = max(abs(a - b) for a, b in zip(got["loss"], ref["loss"]))
        gn_diff = max(abs(a - b) / b for a, b in zip(got["grad_norm"], ref["grad_norm"]))
        w_diff = _max_weight_diff(got["final"], ref["final"])
        same_tp = rank0[(layout[0], 1, 1)]
        w_diff_same_tp = _max_weight_diff(got["final"], same_tp["final"])
        lines.append(f"{layout}: loss {loss_diff:.2e} grad_norm(rel) {gn_diff:.2e} "
                     f"weights {w_diff:.2e} (vs g1 at tp{layout[0]}: {w_diff_same_tp:.2e})")
        assert loss_diff <= LOSS_ATOL, lines[-1]
        assert gn_diff <= GRAD_NORM_RTOL, lines[-1]
        assert w_diff <= WEIGHT_ATOL, lines[-1]
        assert w_diff_same_tp <= WEIGHT_ATOL_SAME_TP, lines[-1]
        for r in results:
            assert r[layout]["n_gtp"] > 0 or layout[1] == 1, layout
            # Replicated grads identical on GTP peers; padding rows never become non-zero.
            assert r[layout]["spread"] == 0.0, (layout, r[layout]["spread"])
            assert r[layout]["pad_max"] == 0.0, (layout, r[layout]["pad_max"])
    # Training moved: the comparison is not between untouched weights.
    assert ref["loss"][-1] < ref["loss"][0]
    assert all(math.isfinite(x) for x in ref["grad_norm"])
    print("\n" + "\n".join(lines))


@pytest.mark.multiprocess
def test_gathered_weights_share_one_buffer_per_shape(world_results):
    """After training, the GTP weights' all-gather buffers (forward and backward) are one per
    padded shape and dtype, not one per weight: gtp.backend returns each backward gather's
    buffer to megatron's pool (megatron-core 0.19.2 does only on its prefetch path), so the
    memory gathered weights take does not grow with the number of layers. The same steps
    matched g1 above, so the sharing changed no value."""
    for r in (w["invariance"] for w in world_results):
        for layout in LAYOUTS + OVERLAP_LAYOUTS:
            if layout[1] > 1:
                assert 0 < r[layout]["ag_buffers"] == r[layout]["ag_keys"], (layout, r[layout])


@pytest.mark.multiprocess
def test_overlapped_collectives_train_exactly_as_in_order_ones(world_results):
    """With megatron's deferred weight-gradient reduce-scatters (the gloo backend's async work
    handles) the same steps give the same losses, grad norms and weights, bit for bit: only
    when the collectives finish changes. Every reduce-scatter but the backward's last was
    async; every gather stayed in order (no weight prefetch on this backend)."""
    for rank, r in enumerate(w["invariance"] for w in world_results):
        for layout in OVERLAP_LAYOUTS:
            got, want = r[layout], r[layout[:3]]
            # same computation: the same collectives in the same order; only when they finish moves
            assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], layout
            assert want["async"] == {"ag": 0, "rs": 0}, layout
            n = got["n_gtp"]
            # Per micro-batch the backward's last GTP weight (the chain head) reduces in place;
            # the first micro-batch of the first step builds the chain.
            assert got["async"]["rs"] >= (STEPS * MICRO_BATCHES - 1) * (n - 1), (layout, got)
            assert got["async"]["ag"] == 0, (layout, got)
            if rank == 0:
                assert all(torch.equal(got["final"][k], want["final"][k]) for k in want["final"])


# --------------------------------------------------------------------------------------------
# Single-process tests.
# --------------------------------------------------------------------------------------------
def test_install_refuses_other_megatron_versions():
    from gtp import backend

    backend.check_megatron_version("0.19.2")
    backend.check_megatron_version("0.19.2+9040d3f")
    for bad in ("0.19.1", "0.20.0", "0.19.3rc1"):
        with pytest.raises(RuntimeError, match=bad.replace("+", r"\+")):
            backend.check_megatron_version(bad)


def test_install_stands_aside_when_transformer_engine_is_usable(monkeypatch):
    from unittest.mock import MagicMock

    from gtp import backend

    gtp = gtp_mod()
    monkeypatch.setattr(backend, "_INSTALLED", False)
    monkeypatch.setattr(gtp, "HAVE_TE", True)
    assert backend.install() is False
    assert isinstance(gtp.gather_along_first_dim, MagicMock)
    assert not backend.is_installed()


def test_resolve_pad_for_alignment():
    from gtp.alignment import resolve_pad_for_alignment

    assert [resolve_pad_for_alignment(None, q) for q in ("none", "fp8", "mxfp8", "nvfp4")] == [
        1, 16, 32, 16]
    assert resolve_pad_for_alignment(0, "mxfp8") == 0
    assert resolve_pad_for_alignment(128, "none") == 128
    with pytest.raises(ValueError, match=r">= 0.*got -1"):
        resolve_pad_for_alignment(-1, "none")
    with pytest.raises(ValueError, match=r"'fp16'.*fp8.*mxfp8.*none.*nvfp4"):
        resolve_pad_for_alignment(None, "fp16")
    with pytest.raises(ValueError, match="fp4"):
        resolve_pad_for_alignment(16, "fp4")


@pytest.mark.parametrize(
    "dim0,g,pad,want_pad,want_shard,rows",
    [
        (192, 4, 16, 0, 48, [48, 48, 48, 48]),
        (192, 4, 32, 64, 64, [64, 64, 64, 0]),
        (1152, 4, 128, 384, 384, [384, 384, 384, 0]),
        (776, 2, 16, 24, 400, [400, 376]),
        (10, 2, 3, 2, 6, [6, 4]),
        (108, 2, 16, 20, 64, [64, 44]),
        (72, 4, 32, 56, 32, [32, 32, 8, 0]),
        (100, 4, 0, 0, 25, [25, 25, 25, 25]),
    ],
)
def test_padding_table_matches_megatron(monkeypatch, dim0, g, pad, want_pad, want_shard, rows):
    from gtp.shards import gtp_padding
    from gtp.shards import logical_rows

    assert gtp_padding(dim0, g, pad) == (want_pad, want_shard)
    assert [hi - lo for lo, hi in (logical_rows(dim0, g, pad, r) for r in range(g))] == rows
    gtp = gtp_mod()
    monkeypatch.setattr(gtp.GTP_CONFIG, "pad_for_alignment", pad)
    group = types.SimpleNamespace(size=lambda: g)
    assert gtp.gtp_remat_shard_dim0(dim0, group) == (want_shard, want_pad)


def test_validate_gtp_dims():
    from gtp.alignment import validate_gtp_dims
    from gtp.shards import gtp_padding

    validate_gtp_dims([72, 216, 200, 272], 4, 1)
    validate_gtp_dims([72, 216, 200], 2, 0)
    with pytest.raises(ValueError, match=r"gtp_remat_size=4.*\[10, 30\]"):
        validate_gtp_dims([72, 10, 200, 30], 4, 0)
    with pytest.raises(ValueError, match="-3"):
        validate_gtp_dims([72], 2, -3)
    with pytest.raises(ValueError, match="gtp_remat_size"):
        gtp_padding(10, 4, 0)


TIED, MTP = "model.share_embeddings_and_output_weights=true", "model.mtp_num_layers=1"


@pytest.mark.parametrize("fields, pp, te_usable, reused, want", [
    ({}, 1, False, None, (False, True)),
    ({}, 2, False, None, (False, False)),
    ({}, 1, True, None, (True, True)),
    ({}, 2, True, None, (True, True)),
    ({"async_reduction": False}, 1, False, None, (False, False)),
    ({"weight_prefetch": False}, 2, True, None, (False, True)),
    ({}, 1, False, TIED, (False, False)),  # a weight used twice: in order on any backend
    ({}, 1, True, TIED, (False, False)),
    ({}, 1, False, MTP, (False, False)),
    ({}, 1, True, MTP, (False, False)),
])
def test_overlap_settings(fields, pp, te_usable, reused, want):
    from recipes.model.gtp_setup import overlap_settings

    got = overlap_settings({"weight_prefetch": None, "async_reduction": None, **fields}, pp,
                           te_usable, reused=reused)
    assert got == dict(zip(("weight_prefetch", "async_reduction"), want))


@pytest.mark.parametrize("overrides, message", [
    (["gtp.weight_prefetch=true"], r"gtp.weight_prefetch=true cannot run here: the gloo backend "
                                   r"has no CUDA streams.*set gtp.weight_prefetch=null or false"),
    (["parallelism=pp2", "gtp.async_reduction=true"],
     r"gtp.async_reduction=true cannot run here: .*pipeline_model_parallel_size=2"),
    (["model=llama_tiny", "model.mtp_num_layers=1", "gtp.async_reduction=true"],
     r"gtp.async_reduction=true cannot run here: with model.mtp_num_layers=1 the model uses a "
     r"GTP weight a second time"),
])
def test_overlap_the_gloo_backend_cannot_run_is_refused_before_launch(monkeypatch, overrides,
                                                                      message):
    from compose import make_cfg

    from recipes.model import te
    from recipes.config.validate import ConfigError, validate

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: False)
    cfg = make_cfg("gtp=tp2_align16", "parallelism.nproc_per_node=4", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 4)
