"""A LLaVA model (tests/helpers/llava.py) saved in megatron-core 0.19.2's own stock format
(padded GTP weights, with the common state a run records but no sharding record) reads
exactly through ``ckpt.stock``: at g2/a16 (the ViT's fc1 pads 24 rows), g4/a32 (the last GTP
shard of the ViT's linear_proj / linear_fc2 and the projector's linear_fc2 is all padding) and
tp1 without GTP, every weight and Adam moment equals its logical golden; written without GTP it
loads exactly into the padded g4/a32 layout, and written at g2/a16 it loads (converted) at
g4/a32. Each of the three sub-models has its own dims (the LLaVA family's
``sub_model_dims``); read with one set, the ViT's and projector's rows come out wrong.

Goldens: ``tests/helpers/layout_goldens.py``'s values, indexed here by hand from the stored
keys (megatron stacks the layers and stores the language model's norms under
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``); logical shapes from the
tp1 checkpoint, which megatron writes without padding.
"""

from __future__ import annotations

import io
import re

import pytest

import layout_goldens
import llava_stock
import module_layouts
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
SAVES = {n: module_layouts.LAYOUTS[n] for n in ("tp1", "g2a16", "g4a32")}
# (source, target): without GTP into a padded GTP layout with an all-padding shard; and a padded
# checkpoint converted and loaded at another GTP layout.
LOADS = [("tp1", "g4a32"), ("g2a16", "g4a32")]
N_PARAMS = 48
# The checkpoint's names of the language model's norms (megatron's sharded_state_dict_keys_map).
NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
MOMENTS = {"": lambda t: t, "exp_avg": lambda t: t + 0.5, "exp_avg_sq": lambda t: t * 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_stock")
    results = run_distributed(llava_stock.save_stock_and_load, WORLD, "llava", str(root), SAVES,
                              LOADS, timeout=300)
    return root, results


def param_names(model_key: str, layers: int) -> list[str]:
    """The parameter name of each slice of a stored model key (one per layer when stacked)."""
    for stored, name in NORMS.items():
        if model_key.startswith("language_model.") and model_key.endswith(stored):
            model_key = model_key[: -len(stored)] + name
    if ".decoder.layers." not in model_key:
        return [model_key]
    return [model_key.replace(".decoder.layers.", f".decoder.layers.{i}.") for i in range(layers)]


def goldens(logical_shapes: dict) -> dict:
    """``{stored key: golden}`` for every model key and its Adam moments."""
    import torch

    from ckpt.stock import split_key

    model = {k: s for k, s in logical_shapes.items() if not split_key(k)[0]}
    names = {k: param_names(k, s[0]) for k, s in model.items()}
    index = {n: k for k, n in enumerate(sorted(n for v in names.values() for n in v), start=1)}
    assert len(index) == N_PARAMS, sorted(index)
    out = {}
    for key, shape in model.items():
        stacked = len(names[key]) > 1 or ".decoder.layers." in key
        per = [layout_goldens.golden_full(index[n], shape[1:] if stacked else shape)
               for n in names[key]]
        full = torch.stack(per) if stacked else per[0]
        for moment, f in MOMENTS.items():
            out[f"optimizer.state.{moment}.{key}" if moment else key] = f(full)
    return out


def test_every_stock_layout_reads_the_logical_weights_and_moments(saved):
    from ckpt import stock

    root, _ = saved
    tp1 = stock.analyze(root / "tp1")
    want = goldens({k: i.stored_shape for k, i in tp1.tensors.items()})
    problems = []
    for name in SAVES:
        analysis, got = stock.read_logical(root / name)
        assert analysis.stock == (SAVES[name][1] > 1), name
        assert set(want) <= set(got), sorted(set(want) - set(got))[:5]
        for key, w in want.items():
            problems.append(layout_goldens.diff(f"{name} {key}", got[key], w))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems[:20])
    g4 = stock.analyze(root / "g4a32").tensors
    # the ViT's fc1 pads 24 rows at g2/a16 and linear_proj's last g4/a32 shard is padding only
    fc1 = "vision_model.decoder.layers.mlp.linear_fc1.weight"
    proj = "vision_model.decoder.layers.self_attention.linear_proj.weight"
    assert stock.analyze(root / "g2a16").tensors[fc1].stored_shape == (2, 224, 72)
    assert (g4[proj].stored_shape, g4[proj].logical_shape) == ((2, 128, 72), (2, 72, 72))


def test_stock_checkpoints_load_exactly_into_padded_gtp_layouts(saved):
    _, results = saved
    assert all(set(r) == set(LOADS) for r in results)
    problems = module_layouts.failures(results, SAVES, N_PARAMS)
    assert not problems, "\n".join(problems[:40])


def test_inspect_describes_the_stock_llava_checkpoint(saved):
    from ckpt.cli import main

    root, _ = saved
    out = io.StringIO()
    assert main(["inspect", str(root / "g4a32")], out=out) == 0
    text = out.getvalue()
    assert "stock padded GTP format" in text and "tp1 x gtp4 (pad_for_alignment=32)" in text
    line = next(x for x in text.splitlines()
                if x.startswith("vision_model.decoder.layers.mlp.linear_fc1.weight "))
    assert re.search(r"\(2, 200, 72\).*STOCK stored \(2, 256, 72\)", line), line


def test_dims_the_record_lacks_come_from_each_sub_models_tensors(saved):
    """The ViT's and the projector's dims (and the language model's width) left out of the
    recorded model config are read from each sub-model's own tensors (biases, in_features; the
    projector's width from its linear_fc2 bias), not from another's; the rows read are the
    same. Model dims given by the caller are refused: they name no sub-model."""
    from ckpt import stock

    root, _ = saved
    path = stock.resolve_iter_dir(root / "g4a32")
    _, want = stock.read_logical(path)
    common = stock.analyze(path).common
    model = common["train_state"]["config"]["model"]
    for k in ("hidden_size", "vision_hidden_size", "vision_ffn_hidden_size",
              "vision_num_attention_heads", "vision_projection_ffn_hidden_size"):
        model[k] = None
    analysis = stock.analyze(path, common=common)
    _, got = stock.read_logical(path, analysis=analysis)
    assert analysis.stock and set(got) == set(want)
    problems = [layout_goldens.diff(k, got[k], want[k]) for k in want]
    assert not any(problems), [p for p in problems if p][:5]
    with pytest.raises(stock.StockCheckpointError, match="model dims given by the caller"):
        stock.analyze(path, "tp=1,gtp=4,pad=32,ffn_hidden_size=200")


def test_without_a_recorded_model_config_the_refusal_does_not_ask_for_dims(saved):
    """No recorded run config at all: the language model's ffn width and SwiGLU are implied by
    no tensor, so the read is refused; the message says a model of sub-models takes no dims
    from the caller (the generic hint asked for ffn_hidden_size=.., which is then refused)."""
    from ckpt import stock

    root, _ = saved
    path = stock.resolve_iter_dir(root / "g4a32")
    common = stock.analyze(path).common
    common["train_state"] = {k: v for k, v in common["train_state"].items() if k != "config"}
    for layout in (None, "tp=1,gtp=4,pad=32"):
        with pytest.raises(stock.StockCheckpointError) as err:
            stock.analyze(path, layout, common=common)
        text = str(err.value)
        assert "a model of sub-models (" in text and "never from --layout" in text, text
        assert "ffn_hidden_size=.." not in text, text
