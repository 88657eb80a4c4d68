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
from recipes.families.moe import hf_import, hf_table

# The fields that size or count stored tensors (ckpt.format.records.unbounded_size).
SIZE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_layer_freq")

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Settings neither class expresses: (field, default, whether a value is exportable, what is).
_EXPORTABLE = (
    ("moe_router_score_function", "softmax", lambda v: v == "softmax", "'softmax'"),
    ("moe_router_topk_scaling_factor", None, lambda v: v in (None, 1, 1.0), "null or 1.0"),
    ("moe_router_enable_expert_bias", False, lambda v: not v, "false"),
    ("moe_router_num_groups", None, lambda v: v in (None, 1), "null"),
    ("moe_router_group_topk", None, lambda v: v is None, "null"),
    ("moe_expert_capacity_factor", None, lambda v: v is None, "null (dropless)"),
    ("moe_shared_expert_intermediate_size", None, lambda v: not v, "null (no shared expert)"),
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
    """How ``arch`` is imported (:mod:`recipes.families.moe.hf_import`)."""
    return HFImport(
        fields=hf_import.moe_fields, table=functools.partial(hf_table.moe, arch),
        prefixes=("model.",), size_fields=hf_import.size_fields(arch),
        layer=r"layers\.(\d+)\.", buffers=(".rotary_emb.inv_freq",))


FORMATS = FamilyFormats(
    name="moe",
    architectures=tuple(
        HFArchitecture(model_type=arch, hf_class=cls, embedding="model.embed_tokens.weight",
                       build=builder(functools.partial(config, arch),
                                     functools.partial(hf_table.moe, arch), "model."),
                       imports=_imports(arch))
        for arch, cls in CLASSES.items()),
    architecture=architecture,
    # Always read (as before model.family): a crafted expert count is refused whatever the family.
    sizes=lambda m: [(f"model.{f}", m.get(f)) for f in SIZE_FIELDS])
