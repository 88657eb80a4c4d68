"""Gated attention (``model.attention_output_gate``, megatron's field) before launch: megatron
gets it, the parameter tables count the gate rows (worked out by hand), a resume refuses a
change, and what cannot run it is refused in one line.

By hand: megatron's ``linear_qkv`` holds, per query group, its query heads, as many gate heads,
then K and V (``SelfAttention.get_query_key_value_tensors``), each ``kv_channels`` rows.
llama_tiny: 6 heads, 2 groups, 12 channels: (6 + 6 + 2 * 2) * 12 = 192 rows (120 without the
gate). moe_tiny: 4 heads, 2 groups, 18 channels: (4 + 4 + 4) * 18 = 216. hybrid_tiny ("M*-M*-"):
4 heads, one group a head, 12 channels: (4 + 4 + 8) * 12 = 192, in layers 1 and 4 only.
"""

from __future__ import annotations

import pytest
import torch
from compose import make_cfg

from ckpt.families import ExportError, for_export
from ckpt.stock.specs import config_layout, logical_rows_global
from recipes.config.parallel_dims import ParallelDims
from recipes.config.shape_fields import changed_shape_fields
from recipes.config.validate import ConfigError, validate
from recipes.families import family_of, gtp_weight_dims, parameter_counts, parameter_shapes

GATE = "model.attention_output_gate=true"
QKV = "self_attention.linear_qkv.weight"


@pytest.mark.parametrize("preset", ["llama_tiny", "moe_tiny", "hybrid_gdn_tiny"])
def test_megatron_gets_the_field_of_each_family_with_attention(preset):
    from recipes.model.build import transformer_config

    for given, want in (((), False), ((GATE,), True)):
        cfg = make_cfg(f"model={preset}", *given)
        dims = ParallelDims.from_config(cfg, 1)
        assert family_of(cfg.model).transformer_config_fields(
            cfg.model, dims)["attention_output_gate"] is want
        # megatron's TransformerEngine spec reads it from the same config (Attention.forward
        # applies the gate whichever linear_qkv the spec builds).
        for use_te in (False, True):
            assert transformer_config(cfg, dims, use_te).attention_output_gate is want


@pytest.mark.parametrize("preset, layers, shape", [
    ("llama_tiny", (0, 1), (192, 72)),
    ("moe_tiny", (0, 1), (216, 72)),
    ("hybrid_tiny", (1, 4), (192, 48)),
])
def test_the_table_counts_the_gate_rows_of_linear_qkv(preset, layers, shape):
    plain, gated = (make_cfg(f"model={preset}", *g).model for g in ((), (GATE,)))
    table = {p.name: p for p in parameter_shapes(gated, 320)}
    rows = {n: p.shape for n, p in table.items() if n.endswith("linear_qkv.weight")}
    assert rows == {f"decoder.layers.{i}.{QKV}": shape for i in layers}
    p = table[f"decoder.layers.{layers[0]}.{QKV}"]
    assert (p.tp_axis, p.gtp) == (0, True)
    # The gate is rows of linear_qkv only: heads * kv_channels x hidden more a layer.
    extra = len(layers) * (shape[0] - {"llama_tiny": 120, "moe_tiny": 144,
                                       "hybrid_tiny": 144}[preset]) * shape[1]
    assert parameter_counts(gated, 320)[0] == parameter_counts(plain, 320)[0] + extra


def test_gtp_shards_the_tp_local_rows_gate_included():
    cfg = make_cfg("model=llama_tiny", GATE, "parallelism=tp2dp2", "gtp.gtp_remat_size=2",
                   "gtp.pad_for_alignment=16")
    assert gtp_weight_dims(cfg, 2)[f"decoder.layers.0.{QKV}"] == 96


@pytest.mark.parametrize("preset", ["llama_tiny", "moe_tiny", "hybrid_gdn_tiny"])
def test_a_resume_refuses_a_changed_gate(preset):
    saved = dict(make_cfg(f"model={preset}").model)
    assert changed_shape_fields(saved, {**saved, "attention_output_gate": True}) == [
        "attention_output_gate"]


MLA = ("model.multi_latent_attention=true", "model.num_attention_heads=4",
       "model.num_query_groups=null", "model.q_lora_rank=40", "model.kv_lora_rank=24",
       "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=12",
       "model.transformer_impl=local")


@pytest.mark.parametrize("overrides, match", [
    (("model=llama_tiny", *MLA), r"^model.multi_latent_attention=true with "
                                 r"model.attention_output_gate=true: megatron-core 0.19.2's "
                                 r"MLATransformerConfig raises NotImplementedError"),
    (("model=moe_tiny", *MLA), r"^model.multi_latent_attention=true with "
                               r"model.attention_output_gate=true:"),
    (("model=llava_tiny", "data=shapes"), r"^model.vision_model_type='clip': "
                                          r"model.attention_output_gate=true: .* use false$"),
])
def test_what_cannot_run_the_gate_is_refused_in_one_line(overrides, match):
    cfg = make_cfg(*overrides, GATE)
    with pytest.raises(ConfigError, match=match) as info:
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("preset", ["llama_tiny", "hybrid_tiny"])
def test_the_gated_presets_validate(preset):
    cfg = make_cfg(f"model={preset}", GATE, "parallelism=tp2dp2", "gtp.gtp_remat_size=2",
                   "gtp.pad_for_alignment=16")
    validate(cfg, cfg.parallelism.nproc_per_node)


def test_the_hugging_face_export_refuses_the_gate():
    model = dict(make_cfg("model=llama_tiny").model)
    assert for_export(model).model_type == "llama"
    with pytest.raises(ExportError, match=r"^model.attention_output_gate=True: no export maps "
                                          r"the gate rows"):
        for_export({**model, "attention_output_gate": True})


def test_the_stock_reader_takes_the_gate_rows_from_the_run_config():
    """A stock checkpoint's run config gives linear_qkv's rows, gate included (the dims alone
    give the rows without it, as for every model without the gate): the reader's source when
    no sharding record gives them (tests/test_mla_layouts.py reads one that does)."""
    config = {"model": dict(make_cfg("model=llama_tiny", GATE).model)}
    dims, _ = config_layout({"train_state": {"config": config}})
    assert dims["qkv_rows"] == 192 and logical_rows_global("qkv", dims) == 192
    config["model"]["attention_output_gate"] = False
    dims, _ = config_layout({"train_state": {"config": config}})
    assert "qkv_rows" not in dims and logical_rows_global("qkv", dims) == 120


def test_a_pretrained_source_without_the_gate_refuses_it(monkeypatch):
    """A Hugging Face source (or a checkpoint saved before the field) records no
    ``attention_output_gate``: it has no gate rows, so a given ``true`` is refused."""
    from recipes.run import pretrained

    source = {k: v for k, v in dict(make_cfg("model=llama_tiny").model).items()
              if k != "attention_output_gate"}
    monkeypatch.setattr(pretrained, "source_config", lambda path: (dict(source),
                                                                    {"vocab_size": 257}))
    cfg = make_cfg("model=llama_tiny", GATE, "checkpoint.pretrained=/tmp/unused")
    with pytest.raises(ConfigError, match=r"model.attention_output_gate=True \(the source has "
                                          r"False\)"):
        pretrained.apply_source(cfg, overrides=[GATE])
    cfg = make_cfg("model=llama_tiny", "checkpoint.pretrained=/tmp/unused")
    pretrained.apply_source(cfg, overrides=[])
    assert cfg.model.attention_output_gate is False


def test_the_output_gate_runs_eagerly_on_cpu():
    """megatron's ``x * sigmoid(gate)`` (``Attention._apply_output_gate``, ``jit_fuser``) runs
    uncompiled after ``mcore_compat.cpu.install``: no ``torch.compile`` stand-in is left (its
    first call would build C++ kernels with Inductor), and it computes the formula."""
    from megatron.core.transformer.attention import Attention

    from mcore_compat import cpu as cpu_compat

    cpu_compat.install(force=True)
    gate_fn = Attention._apply_output_gate
    assert not hasattr(gate_fn, "__wrapped__"), gate_fn
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gate = torch.randn(3, 2, 2, 4, generator=torch.Generator().manual_seed(1))
    want = (x * torch.sigmoid(gate.reshape(3, 2, 8).float())).to(torch.bfloat16)
    assert torch.equal(gate_fn(None, x, gate), want)
