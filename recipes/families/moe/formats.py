"""The MoE family's formats as ``ckpt/`` reads and writes them (given to it by
:mod:`recipes.families.formats`): Mixture-of-Experts checkpoints ->
``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM`` (:func:`ckpt.hf.hf_export.export` drives it),
and back (:mod:`recipes.families.moe.hf_import`, driven by :func:`ckpt.hf.hf_import.import_hf`);
the weight names both ways: :mod:`recipes.families.moe.hf_table`.
Its stock-format GTP weights carry the GPT family's names
(``recipes.families.gpt.formats.GTP_PATTERNS``), so it adds no patterns.

Which class (from the recorded ``model`` config; both need RMSNorm, RoPE over the whole head, no
linear bias and SwiGLU experts, like megatron's Llama-family MoE):

* ``qk_layernorm: false`` -> **Mixtral** (no per-head query/key norm);
* ``qk_layernorm: true`` -> **Qwen3-MoE** (``q_norm`` / ``k_norm``, RMSNorm over the head dim).

Routing. megatron-core 0.19.2 ``TopKRouter.routing`` ->
``transformer.moe.moe_utils.topk_routing_with_score_function`` with ``score_function="softmax"``:

* ``moe_router_pre_softmax=false`` (default): top-k of the logits, then softmax over those k.
  As softmax is monotonic this equals softmax over all experts, top-k, renormalised to sum 1:
  Mixtral's router, and Qwen3-MoE's with ``norm_topk_prob=true``.
* ``moe_router_pre_softmax=true``: softmax over all experts, top-k, not renormalised: Qwen3-MoE
  with ``norm_topk_prob=false``; Mixtral always renormalises, so refused there.

Refused, naming the value: another score function (``sigmoid``, ...), a top-k scaling factor,
expert bias, group-limited routing, token dropping (capacity factor), shared experts
(``moe_shared_expert_intermediate_size``: neither class has an ungated shared expert), dense
layers between MoE layers (``moe_layer_freq`` != 1) and RoPE scaling (untested here).

Tensors (the checkpoint's logical format: per-layer tensors stacked along dim 0, experts along
dim 1 by global expert index) -> transformers >= 5 (fused experts), under ``model.layers.<l>.``:

* ``decoder.layers.mlp.router.weight`` [L, E, H] -> ``mlp.gate.weight`` [E, H];
* ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, 2F, H], rows ``[gate | up]``
  -> ``mlp.experts.gate_up_proj`` [E, 2F, H] (transformers splits it with ``chunk(2)``: gate, up);
* ``decoder.layers.mlp.experts.experts.linear_fc2.weight`` [L, E, H, F]
  -> ``mlp.experts.down_proj`` [E, H, F];
* ``decoder.layers.mlp.linear_fc1.layer_norm_weight`` [L, H] (the pre-MLP norm)
  -> ``post_attention_layernorm.weight``;
* ``decoder.layers.self_attention.{q,k}_layernorm.weight`` [L, D] -> ``self_attn.{q,k}_norm.weight``.

``save_pretrained`` writes the experts in the Hub's per-expert form (Mixtral ``w1``/``w3``/``w2``,
Qwen3-MoE ``gate_proj``/``up_proj``/``down_proj``). Attention and embeddings are mapped as for
Llama. All of these names, both ways: :mod:`recipes.families.moe.hf_table`. Cheap to import (no
megatron, no Hydra, no torch): the ``gtp`` command line loads it.
"""

from __future__ import annotations

import functools
from typing import Any

from ckpt.families import ExportError, FamilyFormats, HFArchitecture, HFImport
from ckpt.hf.mapping import builder
from recipes.families.moe import hf_deepseek, hf_import, hf_table

# The fields that size or count stored tensors (ckpt.format.records.unbounded_size).
SIZE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_shared_expert_gate", "moe_layer_freq")

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           **hf_deepseek.CLASSES}

# Router settings no Hugging Face class of softmax top-k routing expresses (Mixtral's,
# Qwen3-MoE's, Qwen3-Next's): (field, default, whether a value is exportable, what is).
ROUTER_EXPORTABLE = (
    ("moe_router_score_function", "softmax", lambda v: v == "softmax", "'softmax'"),
    ("moe_router_topk_scaling_factor", None, lambda v: v in (None, 1, 1.0), "null or 1.0"),
    ("moe_router_enable_expert_bias", False, lambda v: not v, "false"),
    ("moe_router_num_groups", None, lambda v: v in (None, 1), "null"),
    ("moe_router_group_topk", None, lambda v: v is None, "null"),
    ("moe_expert_capacity_factor", None, lambda v: v is None, "null (dropless)"),
)
# Settings neither class expresses: (field, default, whether a value is exportable, what is).
_EXPORTABLE = ROUTER_EXPORTABLE + (
    ("moe_shared_expert_intermediate_size", None, lambda v: not v, "null (no shared expert)"),
    ("moe_shared_expert_gate", False, lambda v: not v, "false"),
    ("moe_layer_freq", 1, lambda v: v in (None, 1), "1 (every layer MoE)"),
    ("rope_scaling", False, lambda v: not v, "false"),
)


def architecture(model: dict) -> str | None:
    """``"mixtral"`` or ``"qwen3_moe"`` for a recorded MoE ``model`` config dict (see the module
    docstring for the rule), None for a dense model (no ``num_moe_experts``).

    Raises:
        ExportError: a setting neither class computes exactly (the field, its value and what
            is exportable).
    """
    if not model.get("num_moe_experts"):
        return None
    if model.get("multi_latent_attention") or _sigmoid_routed(model):
        return _deepseek_style(model)
    norm = model.get("normalization", "LayerNorm")
    bias = model.get("add_bias_linear", True)
    pos = model.get("position_embedding_type", "learned_absolute")
    swiglu = bool(model.get("swiglu", False))
    if not (norm == "RMSNorm" and not bias and pos == "rope" and swiglu):
        raise ExportError(
            f"no transformers MoE class computes this model exactly: normalization={norm!r}, "
            f"add_bias_linear={bias}, position_embedding_type={pos!r}, swiglu={swiglu}; MoE "
            f"models export with RMSNorm, no bias, rope and SwiGLU experts (Mixtral, Qwen3-MoE)")
    if float(model.get("rotary_percent", 1.0)) != 1.0:
        raise ExportError(f"model.rotary_percent={model.get('rotary_percent')}: only RoPE over "
                          f"the whole head (rotary_percent=1.0) is exported")
    for field, default, exportable, valid in _EXPORTABLE:
        value = model.get(field, default)
        if not exportable(value):
            raise ExportError(f"model.{field}={value!r}: MixtralForCausalLM and "
                              f"Qwen3MoeForCausalLM have no equivalent (exportable: {valid})")
    qk_norm = bool(model.get("qk_layernorm", False))
    if bool(model.get("moe_router_pre_softmax", False)) and not qk_norm:
        raise ExportError(
            "model.moe_router_pre_softmax=True with qk_layernorm=False: megatron does not "
            "renormalise the top-k softmax weights then, and MixtralForCausalLM always does "
            "(Qwen3MoeForCausalLM's norm_topk_prob=false matches, but needs qk_layernorm=True)")
    return "qwen3_moe" if qk_norm else "mixtral"


def _sigmoid_routed(model: dict) -> bool:
    return (model.get("moe_router_score_function", "softmax") == "sigmoid"
            and bool(model.get("moe_router_enable_expert_bias")))


# The DeepSeek-style export's settings: (field, default, whether a value is exportable, what is).
_DEEPSEEK_EXPORTABLE = (
    ("moe_router_score_function", "softmax", lambda v: v == "sigmoid", "'sigmoid'"),
    ("moe_router_enable_expert_bias", False, bool, "true (e_score_correction_bias)"),
    ("moe_router_pre_softmax", False, lambda v: not v, "false"),
    ("moe_shared_expert_gate", False, lambda v: not v, "false (an ungated shared expert)"),
    ("moe_expert_capacity_factor", None, lambda v: v is None, "null (dropless)"),
    ("rope_scaling", False, lambda v: not v, "false (Llama-3 scaling)"),
    ("swiglu", False, bool, "true"),
    ("normalization", "LayerNorm", lambda v: v == "RMSNorm", "'RMSNorm'"),
    ("add_bias_linear", True, lambda v: not v, "false"),
    ("position_embedding_type", "learned_absolute", lambda v: v == "rope", "'rope'"),
)


def _deepseek_style(model: dict) -> str:
    """``"deepseek_v3"`` (multi-latent attention) or ``"glm4_moe"`` for a sigmoid-routed MoE
    model; raises ExportError naming a setting neither computes exactly."""
    arch = "deepseek_v3" if model.get("multi_latent_attention") else "glm4_moe"
    cls = CLASSES[arch]
    for field, default, exportable, valid in _DEEPSEEK_EXPORTABLE:
        value = model.get(field, default)
        if not exportable(value):
            raise ExportError(f"model.{field}={value!r}: {cls} has no equivalent (exportable: "
                              f"{valid})")
    topk, groups = int(model["moe_router_topk"]), model.get("moe_router_num_groups") or 1
    group_topk = model.get("moe_router_group_topk") or 1
    if groups > 1 and topk // group_topk != 2:
        raise ExportError(f"model.moe_router_group_topk={group_topk}: {cls} picks groups by "
                          f"their top-2 sum, megatron by the top moe_router_topk // "
                          f"moe_router_group_topk = {topk // group_topk} (exportable: "
                          f"{topk // 2})")
    width = int(model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"])
    shared = int(model.get("moe_shared_expert_intermediate_size") or 0)
    if shared % width:
        raise ExportError(f"model.moe_shared_expert_intermediate_size={shared}: {cls} has "
                          f"n_shared_experts of moe_intermediate_size={width} each (exportable: "
                          f"a multiple of {width})")
    freq = model.get("moe_layer_freq", 1)
    flags = list(freq) if isinstance(freq, (list, tuple)) else None
    if (flags is None and freq != 1) or (flags and flags != sorted(flags)):
        raise ExportError(f"model.moe_layer_freq={freq!r}: {cls} has dense layers first, then "
                          f"MoE layers only (exportable: 1 or [0, ..., 0, 1, ..., 1])")
    if arch == "deepseek_v3" and model.get("rope_type", "yarn") not in ("rope", "yarn"):
        raise ExportError(f"model.rope_type={model.get('rope_type')!r}: exportable 'rope' or "
                          f"'yarn'")
    if arch == "deepseek_v3" and model.get("rope_type", "yarn") == "yarn":
        unequal = hf_deepseek.yarn_mscale_mismatch(
            float(model.get("rotary_scaling_factor", 40.0)), model.get("mscale", 1.0),
            model.get("mscale_all_dim", 0.0))
        if unequal:
            raise ExportError(f"model.mscale={model.get('mscale', 1.0)}: {unequal}")
    if arch == "deepseek_v3" and model.get("rope_type", "yarn") == "rope":
        # megatron's MLASelfAttention scales the softmax by _yarn_get_mscale(
        # rotary_scaling_factor, mscale_all_dim)^2 whatever the rope_type; transformers' only
        # with YaRN
        factor = float(model.get("rotary_scaling_factor") or 1.0)
        if factor > 1 and float(model.get("mscale_all_dim") or 0.0):
            raise ExportError(f"model.mscale_all_dim={model.get('mscale_all_dim')} with "
                              f"model.rope_type='rope': megatron scales the softmax by YaRN's "
                              f"mscale (rotary_scaling_factor={factor}) whatever the rope "
                              f"type, DeepseekV3ForCausalLM only with YaRN (exportable: "
                              f"mscale_all_dim=0, rotary_scaling_factor <= 1 or rope_type=yarn)")
    return arch


def config(arch: str, m: dict, vocab: int, ids: dict) -> Any:
    """The transformers config of the ``arch`` model (``"mixtral"`` or ``"qwen3_moe"``) from
    the ``model`` config ``m``, the unpadded vocabulary size and the special token ids."""
    import transformers

    h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_layers"]
    groups = m.get("num_query_groups") or heads
    d = m.get("kv_channels") or h // heads
    experts, topk = int(m["num_moe_experts"]), int(m["moe_router_topk"])
    ffn = int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"])
    shared = bool(m.get("share_embeddings_and_output_weights", False))
    common = dict(
        vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=groups, head_dim=d, max_position_embeddings=m["seq_length"],
        rms_norm_eps=m.get("layernorm_epsilon", 1e-5),
        rope_theta=float(m.get("rotary_base", 10000)),
        hidden_act="silu", tie_word_embeddings=shared, num_experts_per_tok=topk,
        attention_dropout=0.0, router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0),
        architectures=[CLASSES[arch]], **ids)
    if arch in hf_deepseek.CLASSES:
        return hf_deepseek.config(arch, m, vocab, ids)
    if arch == "mixtral":
        return transformers.MixtralConfig(
            intermediate_size=ffn, num_local_experts=experts, sliding_window=None,
            router_jitter_noise=0.0, **common)
    return transformers.Qwen3MoeConfig(
        intermediate_size=int(m["ffn_hidden_size"]), moe_intermediate_size=ffn,
        num_experts=experts, norm_topk_prob=not bool(m.get("moe_router_pre_softmax", False)),
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
        attention_bias=False, **common)


def _imports(arch: str) -> HFImport:
    """How ``arch`` is imported (:mod:`recipes.families.moe.hf_import`,
    :mod:`recipes.families.moe.hf_deepseek`)."""
    if arch in hf_deepseek.CLASSES:
        return HFImport(
            fields=getattr(hf_deepseek, f"{arch}_fields"), table=getattr(hf_table, arch),
            prefixes=("model.",), size_fields=hf_deepseek.size_fields(arch),
            layer=r"layers\.(\d+)\.", buffers=(".rotary_emb.inv_freq",),
            sizes=hf_deepseek.sizes, left_out=hf_deepseek.mtp_layers)
    return HFImport(
        fields=hf_import.moe_fields, table=functools.partial(hf_table.moe, arch),
        prefixes=("model.",), size_fields=hf_import.size_fields(arch),
        layer=r"layers\.(\d+)\.", buffers=(".rotary_emb.inv_freq",))


def _table(arch: str):
    return (getattr(hf_table, arch) if arch in hf_deepseek.CLASSES
            else functools.partial(hf_table.moe, arch))


FORMATS = FamilyFormats(
    name="moe",
    architectures=tuple(
        HFArchitecture(model_type=arch, hf_class=cls, embedding="model.embed_tokens.weight",
                       build=builder(functools.partial(config, arch), _table(arch), "model."),
                       imports=_imports(arch))
        for arch, cls in CLASSES.items()),
    architecture=architecture,
    # Always read (as before model.family): a crafted expert count is refused whatever the family.
    sizes=lambda m: [(f"model.{f}", m.get(f)) for f in SIZE_FIELDS])
