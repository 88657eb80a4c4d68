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

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
H, F, V, SEQ = 72, 200, 320, 64
ITER = 3
STEP = 7.0
SENTINEL = -999.0
GARBAGE = -5555.0  # padding rows of params and moments in the stock writer's memory
MODELS = ("tiny", "tiny_swiglu")
# (layer 1 = second layer) logical fc1 row changed in the "perturbed" checkpoint
PERTURB_LAYER, PERTURB_ROW = 1, 110


# ------------------------------------------------------------------------------------------
# Golden values (pure torch; used by the ranks and by the single-process checks)
# ------------------------------------------------------------------------------------------
def _sub(name: str):
    """(value offset, name within its layer) of a GPTModel parameter name."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if m:
        return (int(m.group(1)) + 1) * 1_000_000, m.group(2)
    if name == "embedding.word_embeddings.weight":
        return 0, "word"
    if name == "output_layer.weight":
        return 5_000_000, "out"
    if name == "embedding.position_embeddings.weight":
        return 6_000_000, "pos"
    return 7_000_000, name  # final layernorm


def _full_shape(sub: str, swiglu: bool):
    ff = 2 * F if swiglu else F
    return {
        "word": (V, H), "out": (V, H), "pos": (SEQ, H),
        "self_attention.linear_qkv.weight": (3 * H, H), "self_attention.linear_qkv.bias": (3 * H,),
        "self_attention.linear_proj.weight": (H, H),
        "mlp.linear_fc1.weight": (ff, H), "mlp.linear_fc1.bias": (ff,),
        "mlp.linear_fc2.weight": (H, F),
    }.get(sub, (H,))  # norms, row-parallel biases


def _split(sub: str) -> str | None:
    """How TP splits it: 'rows' (column-parallel / vocab-parallel), 'cols' (row-parallel)."""
    if sub in ("word", "out") or sub.startswith(("self_attention.linear_qkv.weight",
                                                  "self_attention.linear_qkv.bias",
                                                  "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return "rows"
    if sub in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return "cols"
    return None


def full_logical(name: str, swiglu: bool):
    """The whole logical tensor: value = offset + row * 1000 + column (1-D: offset + index).

    Exact in fp32 (< 2**23); Adam moments use -value and value + 0.5 (also exact)."""
    import torch

    off, sub = _sub(name)
    shape = _full_shape(sub, swiglu)
    rows = torch.arange(shape[0], dtype=torch.float64)
    if len(shape) == 1:
        return (off + rows).float()
    cols = torch.arange(shape[1], dtype=torch.float64)
    return (off + rows[:, None] * 1000 + cols[None, :]).float()


def tp_local(name: str, full, tp: int, k: int, swiglu: bool):
    """The TP rank's logical slice, by plain slicing (gated fc1: its gate rows, then up rows)."""
    import torch

    _, sub = _sub(name)
    how = _split(sub)
    if how is None:
        return full
    if how == "cols":
        c = full.shape[1] // tp
        return full[:, k * c:(k + 1) * c]
    if swiglu and sub.startswith("mlp.linear_fc1"):
        h = F // tp
        return torch.cat([full[k * h:(k + 1) * h], full[F + k * h:F + (k + 1) * h]])
    n = full.shape[0] // tp
    return full[k * n:(k + 1) * n]


def gtp_shard(local, shard_rows: int, g: int, r: int, fill: float):
    """GTP rank r's padded shard: the TP-local tensor with tail rows of ``fill``, split in g."""
    import torch

    pad = shard_rows * g - local.shape[0]
    assert 0 <= pad, (local.shape, shard_rows, g)
    padded = torch.cat([local, torch.full((pad, *local.shape[1:]), fill)])
    return padded[r * shard_rows:(r + 1) * shard_rows]


# ------------------------------------------------------------------------------------------
# The 4-rank run
# ------------------------------------------------------------------------------------------
def _named_params(model):
    return dict(getattr(model, "module", model).named_parameters())


def _opt_states(opt):
    """(torch optimizer state dict, param) for every param of megatron's (chained) optimizer."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                yield o, p


def _expected_local(name, p, swiglu, fill=GARBAGE):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    tp = parallel_state.get_tensor_model_parallel_world_size()
    k = parallel_state.get_tensor_model_parallel_rank()
    local = tp_local(name, full_logical(name, swiglu), tp, k, swiglu)
    if is_gtp_param(p):
        local = gtp_shard(local, p.shape[0], p.group.size(), p.group.rank(), fill)
    return local


def _set_golden(model, opt, swiglu):
    import torch

    names = {id(p): n for n, p in _named_params(model).items()}
    with torch.no_grad():
        for name, p in _named_params(model).items():
            p.copy_(_expected_local(name, p, swiglu))
        for o in getattr(opt, "chained_optimizers", [opt]):
            o.init_state_fn(o.optimizer, o.config)  # Adam state before the first step
        for o, p in _opt_states(opt):
            st = o.optimizer.state[p]
            gold = _expected_local(names[id(p)], p, swiglu, fill=0.0)
            garbage = _expected_local(names[id(p)], p, swiglu, fill=GARBAGE) != gold
            st["exp_avg"].copy_(torch.where(garbage, -7777.0, -gold))
            st["exp_avg_sq"].copy_(torch.where(garbage, 7777.0, gold + 0.5))
            st["step"] = torch.tensor(STEP)


def _check_golden(model, opt, swiglu) -> tuple[list, int]:
    import torch

    names = {id(p): n for n, p in _named_params(model).items()}
    problems, checked = [], 0
    for name, p in _named_params(model).items():
        want = _expected_local(name, p, swiglu)
        checked += 1
        if not torch.equal(p.detach(), want):
            bad = (p.detach() != want).nonzero()[0].tolist()
            problems.append(f"{name}: first wrong element {bad}: {p.detach()[tuple(bad)].item()} "
                            f"!= {want[tuple(bad)].item()}")
    for o, p in _opt_states(opt):
        st, want = o.optimizer.state[p], _expected_local(names[id(p)], p, swiglu)
        for key, value in (("exp_avg", -want), ("exp_avg_sq", want + 0.5)):
            checked += 1
            if not torch.equal(st[key], value):
                problems.append(f"{key} of {names[id(p)]} differs")
        if float(st["step"]) != STEP:
            problems.append(f"step of {names[id(p)]}: {st['step']}")
    return problems, checked


def _write_and_reload(root: str, cfgs: dict):
    """On each of 4 ranks: the steps of the module docstring, for each model."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from ckpt.format import logical_format
    from ckpt import io as checkpoint
    from recipes.run import worker
    from recipes.config.schema import to_dict
    from recipes.config.validate import validate

    assert torch.distributed.get_world_size() == 4
    out = {}
    for model_name, paths in cfgs.items():
        swiglu = model_name.endswith("swiglu")
        base = Path(root) / model_name
        cfg = OmegaConf.load(paths["save"])
        parallel_dims = validate(cfg, 4)
        assert (parallel_dims.tensor_model_parallel_size, parallel_dims.gtp_remat_size,
                parallel_dims.pad_for_alignment) == (2, 2, 16), parallel_dims
        _, model, opt, sched = worker.setup(cfg, parallel_dims)
        assert not logical_format.is_installed(), "gtp.checkpoint_layout=stock must be stock"
        _set_golden(model, opt, swiglu)
        record = checkpoint.layout_record(parallel_dims)
        train_state = {"consumed_samples": 48, "wandb_run_id": "stock-test",
                       "config": to_dict(cfg)}
        checkpoint.save_checkpoint(base / "stock", ITER, model, opt, sched, train_state, record)
        logical_format.install()
        checkpoint.save_checkpoint(base / "logical_twin", ITER, model, opt, sched, train_state,
                                   record)
        parallel_state.destroy_model_parallel()

        results = {}
        for tp in (2, 1):
            cfg = OmegaConf.load(paths[f"tp{tp}"])
            parallel_dims = validate(cfg, 4)
            assert (parallel_dims.tensor_model_parallel_size,
                    parallel_dims.gtp_remat_size) == (tp, 1)
            _, model, opt, sched = worker.setup(cfg, parallel_dims)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(SENTINEL)
            record = checkpoint.layout_record(parallel_dims)
            common = checkpoint.load_checkpoint(base / "stock", model, opt, sched, record)
            problems, checked = _check_golden(model, opt, swiglu)
            cache = base / "stock" / "gtp_converted" / f"iter_{ITER:07d}" / ".metadata"
            results[tp] = {"problems": problems, "checked": checked,
                           "iteration": common["iteration"],
                           "consumed": common["train_state"]["consumed_samples"],
                           "cache_mtime": cache.stat().st_mtime_ns}
            if tp == 2:
                checkpoint.save_checkpoint(base / "tp2", ITER, model, opt, sched,
                                           common["train_state"], record)
                # One logical fc1 row changed: TP rank 1 holds fc1 rows F/2.. (non-gated) or
                # gate rows F/2.. (gated) of the logical tensor; local row 10 = row 110.
                if parallel_state.get_tensor_model_parallel_rank() == 1:
                    w = _named_params(model)[f"decoder.layers.{PERTURB_LAYER}.mlp.linear_fc1.weight"]
                    with torch.no_grad():
                        w[PERTURB_ROW - F // 2] += 0.5
                checkpoint.save_checkpoint(base / "perturbed", ITER, model, opt, sched,
                                           common["train_state"], record)
            parallel_state.destroy_model_parallel()
        out[model_name] = results
    return out


# ------------------------------------------------------------------------------------------
# Fixture (shared with test_gtp_cli.py through stock_checkpoints(); built once per session)
# ------------------------------------------------------------------------------------------
_BUILT: dict = {}


def _cfg_file(path: Path, *overrides: str) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["output_dir=/tmp/unused", "checkpoint.save=null",
                                           "data.cache_dir=/tmp/unused", "data=mock",
                                           "logger=none", *overrides])
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))))
    return str(path)


def stock_checkpoints(tmp_path_factory) -> dict:
    """Build (once per session) the checkpoints of the module docstring.

    Returns ``{"root": Path, "results": {model: {tp: {...}}}}``; checkpoints under
    ``root/<model>/{stock,logical_twin,tp2,perturbed}``."""
    if "value" not in _BUILT:
        from multiproc import run_distributed

        root = tmp_path_factory.mktemp("stock_gtp")
        cfgs = {}
        for model in MODELS:
            cfgs[model] = {
                "save": _cfg_file(root / f"{model}_save.yaml", f"model={model}",
                                  "parallelism=tp2dp2", "gtp=tp2_align16",
                                  "gtp.checkpoint_layout=stock"),
                "tp2": _cfg_file(root / f"{model}_tp2.yaml", f"model={model}",
                                 "parallelism=tp2dp2", "gtp=off"),
                "tp1": _cfg_file(root / f"{model}_tp1.yaml", f"model={model}",
                                 "parallelism=tp1", "parallelism.nproc_per_node=4", "gtp=off"),
            }
        results = run_distributed(_write_and_reload, 4, str(root), cfgs, timeout=420)
        assert all(r == results[0] for r in results), "ranks disagree"
        _BUILT["value"] = {"root": root, "results": results[0]}
    return _BUILT["value"]


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
