"""ckpt/format/logical_format.py: the logical checkpoint format, across every layout pair, on CPU.

The matrix (layouts, goldens, the one 4-process world that saves and loads every pair) is
tests/helpers/checkpoint_matrix.py; its docstring says how the goldens are built. These tests
read its results: the plain, Llama-style, pipeline, distributed-optimizer and virtual-pipeline
pairs, what each save records, and the stock-versus-logical asymmetric case.
"""

from __future__ import annotations

import pytest

from checkpoint_matrix import LAYOUTS, LLAMA_LAYOUTS, PP_LAYOUTS, VPP_LAYOUTS, WORLD

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def matrix(checkpoint_matrix):
    """``(root, results)`` of the session's checkpoint matrix."""
    return checkpoint_matrix


def test_every_layout_pair_restores_weights_and_moments_exactly(matrix):
    _, results = matrix
    n_pairs = 0
    for rank, res in enumerate(results):
        assert set(res["loads"]) == {(s, d) for s in LAYOUTS for d in LAYOUTS}
        for (src, dst), (n, problems) in sorted(res["loads"].items()):
            assert n > 50, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
            n_pairs += 1
    assert n_pairs == WORLD * len(LAYOUTS) ** 2


def test_llama_gqa_every_layout_pair_restores_exactly(matrix):
    """GQA QKV (query groups interleaved with K and V), SwiGLU fc1 and every other weight and
    Adam moment of llama_tiny, row by row (rtol=0), for every pair of
    {tp1, tp2, g2/a16, tp2 x g2/a16, tp2 x g2/a64}."""
    _, results = matrix
    for rank, res in enumerate(results):
        loads = res["llama"]["loads"]
        assert set(loads) == {(s, d) for s in LLAMA_LAYOUTS for d in LLAMA_LAYOUTS}
        for (src, dst), (n, problems) in sorted(loads.items()):
            assert n > 40, (src, dst, n)
            assert not problems, f"rank {rank}: llama {src} -> {dst}: {problems[:6]}"
    padded = sum(r["llama"]["coverage"]["tp2g2a16"]["padded"] for r in results)
    straddle = sum(r["llama"]["coverage"]["g2a16"]["straddle"] for r in results)
    assert padded > 0 and straddle > 0, (padded, straddle)


def test_every_save_verifies(matrix):
    """``gtp verify`` reads every byte of every checkpoint the matrix saved: each byte belongs to
    a record of .metadata (an all-padding shard's empty piece, at one offset on several ranks,
    is written by one of them) and every CRC holds."""
    from ckpt import verify

    root, _ = matrix
    iters = sorted(p for p in root.rglob("iter_*") if p.is_dir())
    assert len(iters) >= 13 and any("llama_tp2g2a64" in str(p) for p in iters)
    for path in iters:
        report = verify.verify_iteration(path)
        assert not report.problems, (str(path), [str(p) for p in report.problems[:4]])


def test_built_models_have_the_shapes_of_the_table(matrix):
    """recipes.model.shapes (used by the dry run and the pre-launch GTP checks) equals what megatron
    builds, per rank, for both models at every layout."""
    _, results = matrix
    for rank, res in enumerate(results):
        for name, problems in {**res["shapes"], **{f"llama {k}": v for k, v in
                                                    res["llama"]["shapes"].items()}}.items():
            assert not problems, (rank, name, problems[:5])


def test_padded_branches_ran(matrix):
    _, results = matrix
    total = {name: {k: sum(r["coverage"][name][k] for r in results) for k in
                    ("gtp", "padded", "empty", "straddle")} for name in LAYOUTS}
    assert total["off"]["gtp"] == total["tp2"]["gtp"] == 0
    for name in ("g2a16", "g4a32", "tp2g2a16", "g2a1"):
        assert total[name]["gtp"] > 0, (name, total[name])
    for name in ("g2a16", "g4a32", "tp2g2a16"):
        assert total[name]["padded"] > 0, (name, total[name])
    # g4/a32: GTP rank 3 of linear_proj / linear_fc2 (2 layers each) holds only padding.
    assert total["g4a32"]["empty"] == 4, total["g4a32"]
    # SwiGLU fc1 shards straddling gate and up (2 layers; summed over the 4 ranks, so DP
    # replicas count too): g4/a32 rank 1 (rows 128-256 of 400; dp1), tp2 x g2/a16 GTP rank 0
    # of each TP rank (rows 0-112 of 200; dp1), g2/a16 rank 0 (rows 0-224 of 400; dp2).
    assert total["g4a32"]["straddle"] == 2 and total["tp2g2a16"]["straddle"] == 4, total
    assert total["g2a16"]["straddle"] == 4, total


def test_file_of_every_layout_equals_the_non_gtp_file(matrix):
    """The logical format: a GTP checkpoint holds exactly what the non-GTP model writes."""
    _, results = matrix
    for name, (n, problems) in results[0]["disk"].items():
        assert n > 50 and not problems, (name, problems[:5])


def test_checkpoint_records_its_layout(matrix):
    _, results = matrix
    meta = results[0]["metadata"]
    for name, (tp, g, pad) in LAYOUTS.items():
        m = meta[name]
        assert m["gtp_format"] == "logical-v1", (name, m)
        assert (m["tp"], m["gtp_remat_size"], m["pad_for_alignment"]) == (tp, g, pad or 0), m
        assert m["megatron_core"] == "0.19.2"
        if g == 1:
            assert m["tensors"] == {}, m
            continue
        fc1 = m["tensors"]["decoder.layers.mlp.linear_fc1.weight"]
        assert fc1["gated"] and fc1["tp_axis"] == 0 and fc1["L"] == 400 // tp
        assert fc1["global_shape"] == [400, 72]
        assert fc1["params"] == [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1)]
        proj = m["tensors"]["decoder.layers.self_attention.linear_proj.weight"]
        assert proj["tp_axis"] == 1 and proj["L"] == 72 and not proj["gated"]
        assert proj["global_shape"] == [72, 72]
        assert set(m["tensors"]) == {
            "embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.self_attention.linear_proj.weight",
            "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
        }
    assert meta["g4a32"]["tensors"]["decoder.layers.mlp.linear_fc2.weight"]["pad"] == 56
    assert meta["tp2g2a16"]["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["pad"] == 24


def test_stock_layout_checkpoint_says_so(matrix):
    """checkpoint_layout=stock: megatron 0.19.2's padded format, tagged for the stock reader."""
    _, results = matrix
    meta = results[0]["stock_metadata"]
    assert meta["gtp_format"] == "stock-0.19.2"
    assert (meta["tp"], meta["gtp_remat_size"], meta["pad_for_alignment"]) == (2, 2, 16)
    fc1 = meta["tensors"]["decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1["L"], fc1["pad"], fc1["shard_rows"], fc1["tp_axis"], fc1["gated"]) == (
        100, 28, 64, 0, False)
    proj = meta["tensors"]["decoder.layers.self_attention.linear_proj.weight"]
    assert (proj["L"], proj["pad"], proj["shard_rows"], proj["tp_axis"]) == (72, 24, 48, 1)
    assert proj["global_shape"] == [72, 72]


def test_asymmetric_load_discriminates_stock_from_logical(matrix):
    """tp2 (no GTP) checkpoint -> tp2 x g2/a16 model. fc1 (plain GELU MLP): TP-local L=100,
    pad 28, shard 64. Each row of the checkpoint holds its own index, so the rows a rank got
    can be read back. Stock 0.19.2 reads the rows of TP rank 1 shifted by the pad; gtp/ reads
    them exactly."""
    _, results = matrix
    fc1 = {(r["asym"]["stock"]["fc1"]["tp_rank"], r["asym"]["stock"]["fc1"]["gtp_rank"]):
           r["asym"] for r in results}
    assert sorted(fc1) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    lines = []
    for (tp_rank, gtp_rank), asym in sorted(fc1.items()):
        stock, logical = asym["stock"]["fc1"], asym["logical"]["fc1"]
        assert (stock["L"], stock["pad"]) == (100, 28)
        lo = tp_rank * 100 + min(gtp_rank * 64, 100)
        hi = tp_rank * 100 + min((gtp_rank + 1) * 64, 100)
        wanted = [(lo, hi - 1)] + ([(None, 64 - (hi - lo))] if hi - lo < 64 else [])
        lines.append(f"tp{tp_rank}/g{gtp_rank}: wants {wanted}, stock got {stock['rows']}, "
                     f"logical got {logical['rows']}")
        assert logical["rows"] == wanted, lines[-1]
    print("\n" + "\n".join(lines))
    # Stock 0.19.2 (spec section 3, measured): the loader's padded offsets put TP rank 1's
    # shards 28 rows (the pad) late, and GTP rank 1 of TP rank 0 reads TP rank 1's first rows
    # (zeros would be right there: they are padding).
    assert fc1[(0, 0)]["stock"]["fc1"]["rows"] == [(0, 63)]
    assert fc1[(0, 1)]["stock"]["fc1"]["rows"] == [(64, 127)]
    assert fc1[(1, 0)]["stock"]["fc1"]["rows"] == [(128, 191)]
    assert fc1[(1, 1)]["stock"]["fc1"]["rows"] == [(192, 199), (None, 56)]
    # So the full check fails on stock (weights and moments alike, on the ranks of TP rank 1
    # and on GTP rank 1 of TP rank 0) and passes everywhere with gtp/.
    stock_problems = [p for r in results for p in r["asym"]["stock"]["check"][1]]
    print("stock: " + "\n       ".join(stock_problems[:8]))
    for what in ("linear_fc1.weight weight", "linear_fc1.weight exp_avg",
                 "linear_fc1.weight exp_avg_sq", "linear_qkv.weight weight"):
        assert any(f"decoder.layers.0.mlp.{what}" in p or f"self_attention.{what}" in p
                   for p in stock_problems), what
    for rank, r in enumerate(results):
        n, problems = r["asym"]["logical"]["check"]
        assert n > 50 and not problems, (rank, problems[:5])


def test_pipeline_and_distributed_optimizer_pairs_restore_everything(matrix):
    """Every save/load pair of PP_LAYOUTS: bf16 weights, fp32 main params, exp_avg, exp_avg_sq
    and step equal the goldens, on every rank, padding rows zero."""
    _, results = matrix
    for rank, res in enumerate(results):
        pp = res["pp"]
        assert set(pp["loads"]) == {(s, d) for s in PP_LAYOUTS for d in PP_LAYOUTS}
        for (src, dst), (n, problems) in sorted(pp["loads"].items()):
            assert n > 20, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
    # Each distributed-optimizer rank holds part of the optimizer state, never all of it.
    for name in ("pp2dp2do", "g2a16dp2do"):
        assert all(r["pp"]["filled"][name] > 0 for r in results), name


def test_virtual_pipeline_pairs_restore_everything(matrix):
    """Every save/load pair of VPP_LAYOUTS (pp2 x vpp2 with the distributed optimizer or GTP,
    and pp1): weights, fp32 main params, Adam moments and step equal the goldens on every rank."""
    _, results = matrix
    for rank, res in enumerate(results):
        vpp = res["vpp"]
        assert set(vpp["loads"]) == {(s, d) for s in VPP_LAYOUTS for d in VPP_LAYOUTS}
        for (src, dst), (n, problems) in sorted(vpp["loads"].items()):
            assert n > 20, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
    records = results[0]["vpp"]["records"]
    assert records["l4_pp2v2dp2do"]["virtual_pipeline_model_parallel_size"] == 2


def test_wrong_layer_offset_and_dropped_optimizer_bucket_are_caught(matrix):
    """Negative controls. A pp2 model whose last stage numbers its layers from 0 (a wrong layer
    offset) asks for layer 0 twice and layer 1 never: the load is refused (megatron's sharding
    validation, reported by rank 0; the others report the failure of another rank) and nothing
    is loaded: the weights still hold the sentinel, so the pipeline check fails everywhere. A
    distributed-optimizer save whose first bucket's state was lost (zeros) is found by the
    check on every rank."""
    _, results = matrix
    for rank, res in enumerate(results):
        neg = res["pp"]["negative"]
        wrong = neg["wrong_offset"]
        assert wrong["error"], (rank, wrong)
        if rank == 0:
            assert "Invalid access pattern" in wrong["error"], wrong["error"]
            assert "decoder.layers." in wrong["error"], wrong["error"]
        assert any("weight" in p for p in wrong["problems"]), (rank, wrong["problems"][:3])
        dropped = neg["dropped_bucket"]
        assert any("exp_avg" in p for p in dropped), (rank, dropped[:3])
        assert any("fp32 main param" in p for p in dropped), (rank, dropped[:3])


def test_checkpoint_records_pipeline_and_optimizer(matrix):
    records = matrix[1][0]["pp"]["records"]
    assert records["tp2pp2"]["pipeline_model_parallel_size"] == 2
    assert records["tp2pp2"]["tensor_model_parallel_size"] == 2
    assert records["tp2pp2"]["virtual_pipeline_model_parallel_size"] is None
    assert records["tp1"]["pipeline_model_parallel_size"] == 1
    assert not records["tp1"]["use_distributed_optimizer"]
    do = records["g2a16dp2do"]
    assert do["use_distributed_optimizer"] and do["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    assert (do["gtp_remat_size"], do["data_parallel_size"], do["pad_for_alignment"]) == (2, 2, 16)


def _cli(*argv):
    import io

    from ckpt.cli import main

    out = io.StringIO()
    return main([str(a) for a in argv], out=out), out.getvalue()


def test_inspect_shows_pipeline_and_optimizer(matrix):
    root = matrix[0] / "pp"
    rc, out = _cli("inspect", root / "tp2pp2")
    assert rc == 0, out
    assert "parallelism: tp2 x pp2 (vpp -) x gtp1 x dp1, world 4" in out, out
    assert "optimizer: Adam (megatron's non-distributed optimizer" in out, out
    rc, out = _cli("inspect", root / "g2a16dp2do")
    assert rc == 0, out
    assert "parallelism: tp1 x pp1 (vpp -) x gtp2 (pad 16) x dp2, world 4" in out, out
    assert "optimizer: distributed Adam (megatron's DistributedOptimizer, format " \
           "fully_sharded_model_space)" in out, out


@pytest.mark.parametrize("other", ["pp2", "tp2pp2", "pp2dp2do", "g2a16dp2do"])
def test_compare_equal_across_pipeline_and_optimizer_kinds(matrix, other):
    """Same goldens at every layout: the files hold the same logical tensors (fp32 main params
    named alike whichever optimizer wrote them) and the same step."""
    root = matrix[0] / "pp"
    rc, out = _cli("compare", root / "tp1", root / other)
    assert rc == 0, out
    assert "EQUAL:" in out and "optimizer step 7.0" in out, out
