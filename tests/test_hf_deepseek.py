"""DeepSeek-V3 and GLM-4.5 Hugging Face tables and config mapping at a tiny size, without a
world (recipes/families/moe/hf_table.py, hf_deepseek.py; ckpt/hf/mapping.py's per-layer keys):
the names and shapes are those of transformers' own classes (held and saved), both directions
round-trip exactly, config.json <-> model fields round-trip, and what megatron computes
otherwise is refused by field name."""

from __future__ import annotations

import pytest
import torch

from ckpt import families
from ckpt.hf import mapping
from ckpt.hf.hf_weights import HFImportError, check_sizes

VOCAB, HIDDEN, HEADS, LAYERS = 40, 16, 4, 3
PAD = 3
ROUTING = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
               n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               norm_topk_prob=True)
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=20,
              max_position_embeddings=32, **ROUTING)
MLA = dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5)
# (model_type, transformers config class, class, settings)
CASES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(first_k_dense_replace=1, **MLA)),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                              dict(first_k_dense_replace=0, **{**MLA, "q_lora_rank": None})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(first_k_dense_replace=1, num_key_value_heads=2, head_dim=8,
                      attention_bias=True, use_qk_norm=True)),
}


def _setup(case: str, tied: bool = False):
    import transformers

    cls, model_cls, settings = CASES[case]
    config = getattr(transformers, cls)(tie_word_embeddings=tied, **{**COMMON, **settings})
    imports = families.for_model_type(config.model_type).imports
    m = imports.fields(config)
    return config, model_cls, m, imports


def _sizes(m: dict, imports) -> dict:
    size = {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB,
            "ffn": 20, "experts": 4, "expert_ffn": 6, "groups": m.get("num_query_groups"),
            "head_dim": m.get("kv_channels") or HIDDEN // HEADS}
    return {**size, **imports.sizes(m)}


def _expand(table, prefix: str, size: dict, loaded: bool) -> dict:
    out = {}
    for e in table:
        layers = e.layers if e.layers is not None else range(LAYERS)
        for name, dims in mapping.sizes([e], prefix, loaded).items():
            for i in (layers if "{i}" in name else (0,)):
                for x in (range(size["experts"]) if "{e}" in name else (0,)):
                    out[name.format(i=i, e=x)] = mapping.shape(dims, size)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_shapes_are_transformers(case, tmp_path):
    import transformers
    from safetensors import safe_open

    config, model_cls, m, imports = _setup(case)
    table, size = imports.table(m), _sizes(m, imports)
    model = getattr(transformers, model_cls)(config)
    held = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert _expand(table, "model.", size, loaded=True) == held
    model.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert _expand(table, "model.", size, loaded=False) == saved


def test_dense_first_layers_are_megatron_keys_per_layer():
    """With dense first layers megatron keys each layer's tensors apart (non-homogeneous
    layers): the dense layer's MLP, the MoE layers' router, expert bias and shared expert."""
    _, _, m, imports = _setup("deepseek_v3")
    assert m["moe_layer_freq"] == [0, 1, 1]
    keys = {key for key, *_ in mapping.plan(imports.table(m), m, "model.")}
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.0.self_attention.linear_kv_down_proj.weight"} <= keys
    assert "decoder.layers.0.mlp.router.weight" not in keys
    assert not any(k.startswith("decoder.layers.mlp") for k in keys)
    _, _, m0, imports0 = _setup("deepseek_v3_no_q_lora")
    keys0 = {key for key, *_ in mapping.plan(imports0.table(m0), m0, "model.")}
    assert "decoder.layers.self_attention.linear_q_proj.weight" in keys0  # stacked: all MoE


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loaded", [False, True])
def test_export_then_import_is_the_identity(case, loaded):
    _, _, m, imports = _setup(case)
    table, size = imports.table(m), _sizes(m, imports)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for e in table:
        count = size["experts"] if isinstance(e, mapping.Experts) else 1
        meta = [torch.empty(mapping.shape(d, size), device="meta")
                for _ in range(count) for d in e.dims]
        shape = tuple(e.to_megatron(meta, m).shape)
        shape = (shape[0] + PAD, *shape[1:]) if e.vocab else shape
        for i, key in e.layer_keys(m):
            stacked = (LAYERS,) if e.per_layer and i is None else ()
            tensors[key] = torch.randn(stacked + shape, generator=gen)
    hf = mapping.state_dict(table, tensors, m, VOCAB, "model.", loaded=loaded)
    assert {k: tuple(v.shape) for k, v in hf.items()} == _expand(table, "model.", size, loaded)
    if loaded:
        return  # the loaded names' import is transformers' own load (the saved form is read)
    back = {}
    for key, names, per_layer, fn in mapping.plan(table, m, "model."):
        made = [fn([hf[n.format(i=i)] for n in names])
                for i in (range(LAYERS) if per_layer else (None,))]
        back[key] = torch.stack(made) if per_layer else made[0]
    assert back.keys() == tensors.keys()
    vocab = {e.megatron for e in table if e.vocab}
    for key, t in tensors.items():
        assert torch.equal(back[key], t[:VOCAB] if key in vocab else t), key


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> model fields -> the export's config -> model fields: the same fields."""
    config, _, m, imports = _setup(case)
    arch = families.for_model_type(config.model_type)
    assert families.for_export(m).model_type == config.model_type == arch.model_type
    from recipes.families.moe import hf_deepseek

    exported = hf_deepseek.config(config.model_type, m, VOCAB, {})
    again = imports.fields(exported)
    assert again == m


def _headers(case: str, tmp_path, **changed):
    import transformers

    config, model_cls, _, imports = _setup(case)
    getattr(transformers, model_cls)(config).save_pretrained(tmp_path, safe_serialization=True)
    from ckpt.hf.hf_weights import Weights

    for k, v in changed.items():
        setattr(config, k, v)
    return imports, imports.fields(config), Weights(tmp_path)


def test_sizes_of_a_saved_model_pass_and_a_wrong_rank_is_named(tmp_path):
    imports, m, weights = _headers("deepseek_v3", tmp_path)
    check_sizes(imports, m, VOCAB, weights, "model.")
    imports, m, weights = _headers("deepseek_v3", tmp_path / "b", kv_lora_rank=11)
    with pytest.raises(HFImportError, match="kv_lora_rank"):
        check_sizes(imports, m, VOCAB, weights, "model.")


@pytest.mark.parametrize("field,value,match", [
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("topk_group", 2, "topk_group=2"),
    ("rope_interleave", False, "rope_interleave=False"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("first_k_dense_replace", 3, "first_k_dense_replace=3"),
])
def test_what_megatron_computes_otherwise_is_refused_by_name(field, value, match):
    config, _, _, imports = _setup("deepseek_v3")
    setattr(config, field, value)
    with pytest.raises(HFImportError, match=match):
        imports.fields(config)


def test_top1_sigmoid_weights_are_megatron_s_both_ways():
    """At top-1 megatron's sigmoid router takes the chosen score as is (times the scaling);
    transformers' renormalises it to 1 when norm_topk_prob: the export writes false, the import
    refuses true (the golden: megatron-core 0.19.2 moe_utils.topk_routing_with_score_function's
    sigmoid branch at topk=1, written out: sigmoid(logit) of the argmax of sigmoid + bias)."""
    import transformers
    from recipes.families.moe import hf_deepseek

    config, _, m, imports = _setup("deepseek_v3")
    config.num_experts_per_tok, config.n_group, config.topk_group = 1, 1, 1
    with pytest.raises(HFImportError, match="norm_topk_prob=True"):
        imports.fields(config)
    config.norm_topk_prob = False
    m = imports.fields(config)
    exported = hf_deepseek.config("deepseek_v3", m, VOCAB, {})
    assert imports.fields(exported) == m
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(exported)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
        router.e_score_correction_bias.normal_(generator=gen)
    x = torch.randn(8, HIDDEN, generator=gen)
    _, weights, _ = router(x)
    scores = torch.sigmoid(x @ router.weight.detach().T)
    chosen = (scores + router.e_score_correction_bias).argmax(dim=-1, keepdim=True)
    golden = scores.gather(1, chosen)[:, 0] * m["moe_router_topk_scaling_factor"]
    assert torch.allclose(weights[:, 0], golden, rtol=0, atol=1e-6)
    assert not torch.allclose(golden, torch.full_like(golden, 2.5))  # not all renormalised


def test_a_hub_mtp_layer_is_left_out_of_the_import(tmp_path):
    """DeepSeek-V3's Hub weights hold its multi-token prediction layer after the decoder's
    (num_nextn_predict_layers=1: layer num_hidden_layers, which transformers ignores on load):
    the import leaves it out and writes what the weights without it give (``gtp compare``)."""
    import io
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from ckpt import cli
    from ckpt.hf.hf_import import import_hf

    config, model_cls, _, _ = _setup("deepseek_v3")
    config.num_nextn_predict_layers = 1
    plain, hub = tmp_path / "plain", tmp_path / "hub"
    getattr(transformers, model_cls)(config).save_pretrained(plain, safe_serialization=True)
    getattr(transformers, model_cls)(config).save_pretrained(hub, safe_serialization=True)
    w = load_file(plain / "model.safetensors")
    last = f"model.layers.{LAYERS - 1}."
    mtp = {k.replace(last, f"model.layers.{LAYERS}."): v.clone() for k, v in w.items()
           if k.startswith(last)}
    mtp.update({f"model.layers.{LAYERS}.{k}": torch.ones(2, HIDDEN)
                for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight")})
    save_file({**w, **mtp}, hub / "model.safetensors", metadata={"format": "pt"})
    import_hf(plain, tmp_path / "a")
    import_hf(hub, tmp_path / "b")
    out = io.StringIO()
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")], out=out) == 0, \
        out.getvalue()
    cfg = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFImportError, match="num_hidden_layers=3"):
        import_hf(hub, tmp_path / "c")


def test_plain_rope_export_with_a_softmax_mscale_is_refused():
    """megatron's MLASelfAttention scales the softmax by _yarn_get_mscale(rotary_scaling_factor,
    mscale_all_dim)^2 = (0.1 mscale_all_dim ln(factor) + 1)^2 at rope_type=rope too (written out
    from multi_latent_attention.py); transformers' DeepseekV3Attention only with YaRN: such an
    export is refused, and one with mscale_all_dim=0 exports the softmax scale megatron uses."""
    import math

    import transformers
    from ckpt.families import ExportError
    from recipes.families.moe import hf_deepseek

    _, _, m, _ = _setup("deepseek_v3")
    m = {**m, "rope_type": "rope", "rotary_scaling_factor": 4.0, "mscale_all_dim": 1.0}
    with pytest.raises(ExportError, match=r"model.mscale_all_dim=1.0 with model.rope_type="):
        families.for_export(m)
    m["mscale_all_dim"] = 0.0
    assert families.for_export(m).model_type == "deepseek_v3"
    exported = hf_deepseek.config("deepseek_v3", m, VOCAB, {})
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        exported, layer_idx=0)
    mscale = 0.1 * m["mscale_all_dim"] * math.log(m["rotary_scaling_factor"]) + 1.0
    head = m["qk_head_dim"] + m["qk_pos_emb_head_dim"]
    assert attention.scaling == pytest.approx(mscale * mscale / math.sqrt(head), rel=1e-12)


@pytest.mark.parametrize("mscale,mscale_all_dim,exportable", [
    (1.0, 1.0, True), (0.7, 0.9, True), (1.0, 0.0, True), (0.5, 0.0, False), (0.0, 1.0, False)])
def test_yarn_mscale_that_transformers_reads_otherwise_is_refused(mscale, mscale_all_dim,
                                                                  exportable):
    """YaRN's cos/sin scale: megatron's YarnRotaryEmbedding (its _yarn_get_mscale ratio, the
    golden) against transformers' own yarn init of the exported config; where they differ the
    export and the import refuse, naming mscale."""
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_mscale)
    from ckpt.families import ExportError
    from recipes.families.moe import hf_deepseek

    config, _, m, imports = _setup("deepseek_v3")
    m = {**m, "rope_type": "yarn", "rotary_scaling_factor": 4.0, "mscale": mscale,
         "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 8}
    megatron = _yarn_get_mscale(4.0, mscale) / _yarn_get_mscale(4.0, mscale_all_dim)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": mscale,
            "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 8}
    config.rope_parameters = rope  # as the export writes them (hf_deepseek.config)
    _, theirs = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert (abs(theirs - megatron) < 1e-9) == exportable
    if exportable:
        assert families.for_export(m).model_type == "deepseek_v3"
        assert imports.fields(config)["mscale"] == mscale
        return
    with pytest.raises(ExportError, match=rf"model.mscale={mscale}: YaRN's cos/sin scale"):
        families.for_export(m)
    with pytest.raises(HFImportError, match=rf"rope_parameters.mscale={mscale}"):
        imports.fields(config)


def test_yarn_without_factor_is_refused():
    """megatron's rotary_scaling_factor would be its default 40, transformers' the ratio of
    max_position_embeddings to the original: refused, naming the field."""
    config, _, _, imports = _setup("deepseek_v3")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0,
                              "original_max_position_embeddings": 8}
    with pytest.raises(HFImportError, match=r"rope_parameters.factor=None"):
        imports.fields(config)
