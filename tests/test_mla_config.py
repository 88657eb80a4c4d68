"""Multi-latent attention before launch: megatron's fields, the parameter table (worked out by
hand from llama_tiny's dims with MLA: hidden 72, 4 heads, q_lora_rank 40, kv_lora_rank 24,
qk_head_dim 16, qk_pos_emb_head_dim 8, v_head_dim 12, RMSNorm, no biases, SwiGLU ffn 200,
vocab 257 padded to 320, untied), the refusals, and the families that do not build it."""

from __future__ import annotations

import pytest
from compose import make_cfg

from ckpt.families import ExportError, for_export
from recipes.config.shape_fields import changed_shape_fields
from recipes.config.validate import ConfigError, validate
from recipes.families import family_of, gtp_weight_dims, parameter_counts, parameter_shapes
from recipes.config.parallel_dims import ParallelDims

MLA = ("model.multi_latent_attention=true", "model.num_attention_heads=4",
       "model.num_query_groups=null", "model.q_lora_rank=40", "model.kv_lora_rank=24",
       "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=12",
       "model.qk_layernorm=true", "model.transformer_impl=local")
# One layer's attention: input norm 72; q_down 40 x 72, q norm 40, q_up 4 * (16 + 8) = 96 x 40;
# kv_down (24 + 8) = 32 x 72, kv norm 24, kv_up 4 * (16 + 12) = 112 x 24; proj 72 x 4 * 12.
ATTENTION = 72 + 40 * 72 + 40 + 96 * 40 + 32 * 72 + 24 + 112 * 24 + 72 * 48
MLP = 72 + 400 * 72 + 72 * 200
EMBEDDING = 320 * 72
# name: (shape, dim TP splits, GTP-sharded)
TABLE = {
    "input_layernorm.weight": ((72,), None, False),
    "self_attention.linear_q_down_proj.weight": ((40, 72), 0, True),
    "self_attention.q_layernorm.weight": ((40,), None, False),
    "self_attention.linear_q_up_proj.weight": ((96, 40), 0, True),
    "self_attention.linear_kv_down_proj.weight": ((32, 72), 0, True),
    "self_attention.kv_layernorm.weight": ((24,), None, False),
    "self_attention.linear_kv_up_proj.weight": ((112, 24), 0, True),
    "self_attention.linear_proj.weight": ((72, 48), 1, True),
}


def _cfg(*overrides: str):
    return make_cfg("model=llama_tiny", *MLA, *overrides)


def test_megatron_gets_the_mla_fields_only_with_mla():
    plain = make_cfg("model=llama_tiny")
    cfg = _cfg("model.rotary_base=5000")
    dims = ParallelDims.from_config(cfg, 1)
    assert "multi_latent_attention" not in family_of(plain.model).transformer_config_fields(
        plain.model, dims)
    fields = family_of(cfg.model).transformer_config_fields(cfg.model, dims)
    assert {k: fields[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                                   "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                                   "rope_type", "rotary_base", "qk_layernorm")} == {
        "multi_latent_attention": True, "q_lora_rank": 40, "kv_lora_rank": 24, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "rope_type": "yarn", "rotary_base": 5000,
        "qk_layernorm": True}
    # megatron's MLATransformerConfig defaults, for what the preset does not set.
    assert (fields["rotary_scaling_factor"], fields["original_max_position_embeddings"],
            fields["beta_fast"], fields["beta_slow"], fields["mscale"],
            fields["mscale_all_dim"]) == (40.0, 4096, 32.0, 1.0, 1.0, 0.0)


def test_the_table_has_each_projection_with_its_split_and_the_count_by_hand():
    m = _cfg().model
    shapes = {p.name: p for p in parameter_shapes(m, 320)}
    for i in range(2):
        for name, (shape, tp_axis, gtp) in TABLE.items():
            p = shapes[f"decoder.layers.{i}.{name}"]
            assert (p.shape, p.tp_axis, p.gtp) == (shape, tp_axis, gtp), name
        assert f"decoder.layers.{i}.self_attention.linear_qkv.weight" not in shapes
    assert parameter_counts(m, 320) == (2 * (ATTENTION + MLP) + 72 + 2 * EMBEDDING,) * 2
    assert parameter_counts(m, 320)[0] == 163_304


def test_without_q_lora_rank_one_linear_q_proj_from_the_hidden_state():
    m = _cfg("model.q_lora_rank=null", "model.qk_layernorm=false",
             "model.add_bias_linear=true").model
    names = {p.name: p for p in parameter_shapes(m, 320) if ".layers.0.self_attention." in p.name}
    prefix = "decoder.layers.0.self_attention."
    assert names.keys() == {prefix + k for k in (
        "linear_q_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight",
        "linear_proj.weight", "linear_proj.bias")}
    q = names[prefix + "linear_q_proj.weight"]
    assert (q.shape, q.tp_axis, q.gtp) == ((96, 72), 0, True)


def test_gtp_shards_the_tp_local_rows_of_every_projection():
    cfg = _cfg("parallelism=tp2dp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16")
    dims = gtp_weight_dims(cfg, 2)
    layer = {k.split("self_attention.")[1]: v for k, v in dims.items()
             if k.startswith("decoder.layers.0.self_attention.")}
    assert layer == {"linear_q_down_proj.weight": 20, "linear_q_up_proj.weight": 48,
                     "linear_kv_down_proj.weight": 16, "linear_kv_up_proj.weight": 56,
                     "linear_proj.weight": 72}


def test_moe_models_take_the_fields_and_resumes_compare_them():
    m = make_cfg("model=moe_tiny", *MLA).model
    names = {p.name for p in parameter_shapes(m, 320)}
    assert "decoder.layers.0.self_attention.linear_kv_up_proj.weight" in names
    moe = dict(m)
    assert changed_shape_fields(moe, {**moe, "qk_head_dim": 8}) == ["qk_head_dim"]
    dense = dict(_cfg().model)
    assert changed_shape_fields(dense, {**dense, "q_lora_rank": None}) == ["q_lora_rank"]
    assert changed_shape_fields(dense, {**dense, "kv_lora_rank": 32}) == ["kv_lora_rank"]


@pytest.mark.parametrize("overrides, match", [
    (["model.rope_type=linear"], r"model.rope_type='linear' with model.multi_latent_attention=true:"
                                 r" valid are \('rope', 'yarn'\)"),
    (["model.kv_lora_rank=0"], r"model.kv_lora_rank=0 is invalid"),
    (["model.q_lora_rank=0"], r"model.q_lora_rank=0 is invalid"),
    (["model.qk_pos_emb_head_dim=7", "model.kv_lora_rank=25"],
     r"model.qk_pos_emb_head_dim=7 must be even"),
    (["model.rotary_scaling_factor=0"], r"model.rotary_scaling_factor=0.0 must be > 0"),
    (["model.rope_type=yarn", "model.beta_fast=0"], r"model.beta_fast=0.0 must be > 0"),
    (["model.rope_type=yarn", "model.beta_slow=-1"], r"model.beta_slow=-1.0 must be > 0"),
    (["model.position_embedding_type=learned_absolute"],
     r"position_embedding_type='learned_absolute': MLA applies RoPE"),
    (["model.rope_scaling=true"], r"model.rope_scaling=true: MLA's RoPE takes no Llama-3.1"),
    (["model.num_query_groups=2"], r"model.num_query_groups=2: every MLA head has its own key"),
    (["model.kv_channels=12"], r"model.kv_channels=12: MLA's head widths"),
    (["model.add_qkv_bias=true"], r"model.add_qkv_bias=true: megatron's MLA projections"),
    (["model.q_lora_rank=null"], r"model.q_lora_rank=null with model.qk_layernorm=true"),
    (["parallelism=tp2dp2", "model.q_lora_rank=41"],
     r"model.q_lora_rank=41 must be divisible by tensor_model_parallel_size=2"),
    (["parallelism=tp2dp2", "model.kv_lora_rank=25"],
     r"model.kv_lora_rank \+ model.qk_pos_emb_head_dim = 25 \+ 8 = 33 must be divisible by "
     r"tensor_model_parallel_size=2"),
])
def test_what_mla_cannot_run_is_refused_in_one_line_naming_the_field(overrides, match):
    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError, match=match) as info:
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert "\n" not in str(info.value)


def test_transformer_engine_layers_are_refused(monkeypatch):
    from recipes.model import te

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: True)
    cfg = _cfg("model.transformer_impl=null")
    with pytest.raises(ConfigError, match=r"model.multi_latent_attention=true runs megatron's "
                                          r"local layers: set model.transformer_impl=local"):
        validate(cfg, cfg.parallelism.nproc_per_node)


def test_a_valid_mla_config_passes_at_tp2_and_gtp():
    cfg = _cfg("parallelism=tp2dp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
               "parallelism.nproc_per_node=4")
    validate(cfg, 4)


@pytest.mark.parametrize("family", [("model=hybrid_tiny",), ("model=llava_tiny", "data=shapes")])
def test_the_families_without_mla_refuse_it(family):
    cfg = make_cfg(*family, "model.multi_latent_attention=true")
    with pytest.raises(ConfigError, match=r"model.multi_latent_attention=true with model.family="
                                          r"'(hybrid|llava)': multi-latent attention is built "
                                          r"by the families \('gpt', 'moe'\)"):
        validate(cfg, cfg.parallelism.nproc_per_node)


def test_export_of_a_dense_mla_model_is_refused():
    with pytest.raises(ExportError, match=r"model.multi_latent_attention=True without routed "
                                          r"experts"):
        for_export(dict(_cfg().model))
