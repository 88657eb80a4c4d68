"""Stock GTP checkpoints written by stock megatron-core 0.19.2 read exactly at other layouts.

One spawn of 4 gloo ranks (world size asserted by ``multiproc``) does, for the tiny model and
its SwiGLU twin (hidden 72, ffn 200):

1. build the model at tp2 x gtp2 with pad_for_alignment 16 and ``gtp.checkpoint_layout=stock``
   (megatron 0.19.2's padded writer), set every parameter to a golden value that encodes its
   global logical row (and column, and layer), every Adam moment to a value derived from it,
   every padding row to garbage and the Adam step to 7, and save: the stock checkpoint. The
   golden of each rank is computed here by plain slicing of a full logical tensor (TP split,
   gate/up halves, tail padding, GTP split), independently of ``gtp.shards``;
2. with the logical writer (``ckpt.format.logical_format``) save the same model again: its logical twin;
3. load the stock checkpoint into a non-GTP model at tp2 (dp2) and at tp1 (dp4), every
   parameter pre-filled with -999, through ``ckpt.io.load_checkpoint`` (which
   converts it once into ``<root>/gtp_converted``), and check every parameter, both Adam
   moments and the step against the golden, bit for bit;
4. at tp2 save it again (a non-GTP twin) and save a copy with one row changed (for the CLI tests).

Stock megatron cannot do step 3 at all (global shape mismatch). Without TE the stock GTP writer
only runs because ``gtp.backend`` turns megatron's GTP checkpoint path on; the stored shapes
asserted below are those of the spec's section 3 (e.g. fc1 (2, 256, 72) = tp2 x (100 + 28)).
"""

from __future__ import annotations

import pytest

from stock_goldens import ITER, MODELS, STEP, full_logical, stock_checkpoints

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    return stock_checkpoints(tmp_path_factory)


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_stock_writer_wrote_a_padded_checkpoint(built, model):
    from ckpt import stock

    a = stock.analyze(built["root"] / model / "stock")
    assert a.format == "stock" and a.stock
    assert (a.layout.tp, a.layout.g, a.layout.pad_for_alignment) == (2, 2, 16)
    fc1 = a.tensors["decoder.layers.mlp.linear_fc1.weight"]
    qkv = a.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    proj = a.tensors["decoder.layers.self_attention.linear_proj.weight"]
    # spec section 3: column-parallel tp*(L+pad), row-parallel L+pad
    if model == "tiny":
        assert fc1.stored_shape == (2, 256, 72) and fc1.logical_shape == (2, 200, 72)
    else:  # L = 200 per TP rank, pad 24 -> 2 x 224
        assert fc1.stored_shape == (2, 448, 72) and fc1.logical_shape == (2, 400, 72)
        assert fc1.gtp.gated
    assert qkv.stored_shape == (2, 256, 72) and qkv.logical_shape == (2, 216, 72)
    assert proj.stored_shape == (2, 96, 72) and proj.logical_shape == (2, 72, 72)
    # Adam moments are sharded like their param
    assert a.tensors["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"].stock
    # the vocab rows need no padding at tp2 x gtp2/a16 (L = 160): same rows as logical
    assert not a.tensors["embedding.word_embeddings.weight"].stock


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [2, 1])
def test_stock_checkpoint_loads_exactly_without_gtp(built, model, tp):
    res = built["results"][model][tp]
    assert res["problems"] == [], res["problems"][:10]
    # every parameter (17 per rank, 18 ... with layer-wise names) plus 2 moments each
    assert res["checked"] >= 3 * 26, res["checked"]
    assert (res["iteration"], res["consumed"]) == (ITER, 48)


@pytest.mark.parametrize("model", MODELS)
def test_second_load_reuses_the_conversion(built, model):
    res = built["results"][model]
    assert res[1]["cache_mtime"] == res[2]["cache_mtime"]


def test_prepare_load_decisions(built):
    """Single process: what the load hook does with each kind of checkpoint."""
    from megatron.core import dist_checkpointing

    from ckpt import stock

    root = built["root"] / "tiny"
    path = stock.resolve_iter_dir(root / "stock")
    common = dist_checkpointing.load_common_state_dict(str(path))
    # stock, converted copy already there: reused
    assert stock.prepare_load(path, common, {}) == (root / "stock" / "gtp_converted" / path.name,
                                                     True)
    # the loader writes the stock format at the very same layout (its record, pad included):
    # megatron reads it as is; at another pad_for_alignment it is converted
    from ckpt.format.records import saved_layout

    same = saved_layout(common)
    assert same["pad_for_alignment"] == 16 and "pad_for_alignment" not in common["layout"]
    assert stock.prepare_load(path, common, same, stock_writer=True) == (path, False)
    assert stock.prepare_load(path, common, {**same, "pad_for_alignment": 32},
                               stock_writer=True)[1]
    # a non-GTP checkpoint and a logical one are loaded as they are
    for name in ("tp2", "logical_twin"):
        other = stock.resolve_iter_dir(root / name)
        other_common = dist_checkpointing.load_common_state_dict(str(other))
        assert stock.prepare_load(other, other_common, {}) == (other, False)
        assert not stock.is_stock(other)


def test_prepare_load_of_a_renamed_iter_dir(built, tmp_path):
    """A stock iter dir copied under another name (its recorded iteration is 3, the folder says
    99) is converted into ``gtp_converted/iter_0000099`` and holds the same tensors."""
    import shutil

    import torch
    from megatron.core import dist_checkpointing

    from ckpt import stock

    src = stock.resolve_iter_dir(built["root"] / "tiny" / "stock")
    renamed = tmp_path / "copy" / "iter_0000099"
    shutil.copytree(src, renamed)
    common = dist_checkpointing.load_common_state_dict(str(renamed))
    assert common["iteration"] == ITER
    where, converted = stock.prepare_load(renamed, common, {})
    assert converted and where == tmp_path / "copy" / "gtp_converted" / "iter_0000099"
    _, want = stock.read_logical(src)
    _, got = stock.read_logical(where)
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert torch.equal(got[key], t), key


def test_no_viable_layout_names_the_weight_that_rules_them_out(built):
    """Layout not recorded and one weight (linear_qkv, 999 rows) that no layout explains: the
    refusal names it, not the first weight in sorted order (linear_fc1, which layouts explain)."""
    import dataclasses

    from ckpt import stock
    from ckpt.stock import analysis, saving_layout

    path = stock.resolve_iter_dir(built["root"] / "tiny" / "stock")
    ck = analysis._read_checkpoint(path, None, None)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert sorted(ck.gtp_bases)[0] < qkv and qkv in ck.gtp_bases
    (suffix, shape), = ck.gtp_bases[qkv].items()
    crafted = dataclasses.replace(
        ck, items={}, meta={}, source="nothing recorded",
        gtp_bases={**ck.gtp_bases, qkv: {suffix: (*shape[:-2], 999, shape[-1])}})
    with pytest.raises(stock.StockCheckpointError, match="no layout explains") as err:
        saving_layout._resolve(crafted)
    assert f"{qkv} is stored with shape" in str(err.value), str(err.value)


@pytest.mark.parametrize("model", MODELS)
def test_read_logical_equals_the_golden(built, model):
    """Single process: every reconstructed model tensor and moment equals the full golden."""
    import torch

    from ckpt import stock

    swiglu = model.endswith("swiglu")
    analysis, tensors = stock.read_logical(built["root"] / model / "stock")
    checked = 0
    for key, t in tensors.items():
        prefix, mkey = stock.split_key(key)
        if mkey.startswith("decoder.layers."):
            sub = mkey[len("decoder.layers."):]
            name_sub = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
                        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}.get(sub, sub)
            want = torch.stack([full_logical(f"decoder.layers.{i}.{name_sub}", swiglu)
                                for i in range(2)])
        else:
            want = full_logical(mkey, swiglu)
        if prefix.endswith(".exp_avg."):
            want = -want
        elif prefix.endswith(".exp_avg_sq."):
            want = want + 0.5
        assert torch.equal(t, want), key
        checked += 1
    assert checked == 51
    assert analysis.common["optimizer"]["state"]["common_step"] == STEP


@pytest.mark.parametrize("model", MODELS)
def test_conversion_is_cached_and_logical(built, model):
    from ckpt import stock

    root = built["root"] / model / "stock"
    conv = root / stock.CONVERTED_DIR / f"iter_{ITER:07d}"
    a = stock.analyze(conv)
    assert a.format == "logical" and not a.stock
    rec = a.common[stock.CONVERTED_KEY]
    assert rec["saved_layout"] == {"tensor_model_parallel_size": 2, "gtp_remat_size": 2,
                                   "pad_for_alignment": 16}
    assert a.common["layout"]["gtp_remat_size"] == 1 and "pad_for_alignment" not in a.common["layout"]
    from ckpt.format.records import saved_layout
    assert saved_layout(a.common)["pad_for_alignment"] == 0
    assert "decoder.layers.mlp.linear_fc1.weight" in rec["legacy_keys"]
    # shapes are those of the non-GTP tp2 twin written by megatron itself
    twin = stock.analyze(built["root"] / model / "tp2")
    assert {k: i.stored_shape for k, i in a.tensors.items()} == \
        {k: i.stored_shape for k, i in twin.tensors.items()}


@pytest.mark.parametrize("model", MODELS)
def test_layout_from_metadata_and_from_run_config_agree(built, model):
    """The stock file carries ckpt.format.logical_format's stock-0.19.2 record; without it the layout
    record and the run config give the same reading."""
    from megatron.core import dist_checkpointing

    from ckpt import stock

    path = stock.resolve_iter_dir(built["root"] / model / "stock")
    common = dist_checkpointing.load_common_state_dict(str(path))
    with_meta = stock.analyze(path, common=common)
    if stock.SHARDING_RECORD_KEY in common:
        assert common[stock.SHARDING_RECORD_KEY]["gtp_format"] == stock.FORMAT_STOCK
        assert "sharding record" in with_meta.layout_source
    stripped = {k: v for k, v in common.items() if k != stock.SHARDING_RECORD_KEY}
    from_cfg = stock.analyze(path, common=stripped)
    assert "sharding record" not in from_cfg.layout_source
    for key, info in with_meta.tensors.items():
        other = from_cfg.tensors[key]
        assert (info.stock, info.logical_shape, info.rowmap) == \
            (other.stock, other.logical_shape, other.rowmap), key


def _stripped(built, model):
    """The stock checkpoint's iter dir and its common state without anything that records the
    layout or the model (no ``layout``, no run config, no sharding record)."""
    from megatron.core import dist_checkpointing

    from ckpt import stock

    path = stock.resolve_iter_dir(built["root"] / model / "stock")
    common = dist_checkpointing.load_common_state_dict(str(path))
    return path, {k: v for k, v in common.items()
                  if k not in ("layout", "train_state", stock.SHARDING_RECORD_KEY)}


def test_refused_when_the_layout_is_unknown(built):
    """Nothing recorded: the stored shapes fit several layouts; where those read different
    rows, nothing is read and the message names the tensor, its stored shape, the layouts that
    explain it and how to pass one. Given what is missing, it reads exactly."""
    import torch

    from ckpt import stock

    # tiny: only tp2 layouts of alignment 32 explain every shape, and they read the same rows
    # (without gated weights the GTP split does not move rows) - but the vocab size is open.
    path, stripped = _stripped(built, "tiny")
    with pytest.raises(stock.StockCheckpointError) as err:
        stock.analyze(path, common=stripped)
    msg = str(err.value)
    assert "neither recorded nor given" in msg
    assert "embedding.word_embeddings.weight stored with shape (320, 72) is ambiguous" in msg
    assert "padded_vocab_size" in msg and "tp=2,gtp=2,pad=16" in msg and "--layout" in msg
    a = stock.analyze(path, "padded_vocab_size=320", common=stripped)
    full = stock.analyze(path)
    assert a.stock and "3 equivalent layouts" in a.layout_source
    assert all(a.tensors[k].rowmap == full.tensors[k].rowmap for k in full.tensors)
    _, got = stock.read_logical(path, analysis=a)
    _, want = stock.read_logical(path, analysis=full)
    assert all(torch.equal(got[k], want[k]) for k in want)

    # tiny_swiglu: the gated fc1's rows depend on the GTP degree: refused even with the vocab.
    path, stripped = _stripped(built, "tiny_swiglu")
    with pytest.raises(stock.StockCheckpointError) as err:
        stock.analyze(path, "padded_vocab_size=320", common=stripped)
    msg = str(err.value)
    assert ("decoder.layers.mlp.linear_fc1.weight stored with shape (2, 448, 72) is explained "
            "by 3 layouts that read different rows") in msg
    assert "tp=2,gtp=2,pad=16, tp=2,gtp=4,pad=8, tp=2,gtp=8,pad=4" in msg
    assert "--layout" in msg
    a = stock.analyze(path, "tp=2,gtp=2,pad=16,padded_vocab_size=320", common=stripped)
    assert a.stock and a.layout_source.startswith("given by the caller")
    full = stock.analyze(path)
    assert all(a.tensors[k].rowmap == full.tensors[k].rowmap for k in full.tensors)


def test_refused_when_the_given_layout_cannot_explain_a_shape(built):
    from ckpt import stock

    with pytest.raises(stock.StockCheckpointError) as err:
        stock.analyze(built["root"] / "tiny" / "stock", "tp=2,gtp=2,pad=32")
    msg = str(err.value)
    assert "decoder.layers.mlp.linear_fc2.weight is stored with shape (2, 96, 200)" in msg
    assert "tp2 x gtp2 (pad_for_alignment=32)" in msg and "gives dim 0 128" in msg
    explaining = msg.split("Layouts that explain this stored shape: ", 1)[1].split(";")[0]
    assert "tp=2,gtp=2,pad=16" in explaining and "tp=2,gtp=4,pad=8" in explaining, explaining
