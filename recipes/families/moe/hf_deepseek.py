"""DeepSeek-style MoE models both ways between Hugging Face config.json and the ``model``
fields (megatron's names): ``DeepseekV3ForCausalLM`` (DeepSeek-V3/R1, Kimi-K2, Moonlight) and
``Glm4MoeForCausalLM`` (GLM-4.5). Their weight names: :mod:`recipes.families.moe.hf_table`.

Both route with megatron-core 0.19.2's ``topk_routing_with_score_function(score_function=
"sigmoid")``: sigmoid scores, the expert bias (``e_score_correction_bias``, megatron's
``router.expert_bias``) added for the choice only, the top-k weights renormalised and times
``routed_scaling_factor`` (``moe_router_topk_scaling_factor``); group-limited routing picks
``topk_group`` of ``n_group`` groups by the sum of each group's top ``topk // topk_group``
scores (megatron's ``group_limited_topk``), which is DeepSeek's top-2 sum only when
``num_experts_per_tok // topk_group == 2``. The first ``first_k_dense_replace`` layers are dense
(``moe_layer_freq`` as a list), the ``n_shared_experts`` shared experts one MLP of
``n_shared_experts * moe_intermediate_size`` (``moe_shared_expert_intermediate_size``).

DeepSeek-V3's attention is multi-latent attention (``multi_latent_attention``: ``q_lora_rank``,
``kv_lora_rank``, ``qk_head_dim`` = ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` =
``qk_rope_head_dim``, ``v_head_dim``) whose RoPE megatron applies to the de-interleaved rope
dims, as transformers' ``rope_interleave=true``; YaRN scaling maps to megatron's ``rope_type:
yarn`` fields. GLM-4.5's is Llama's with q/k/v biases (``attention_bias``), optional q/k norms
and RoPE over ``partial_rotary_factor`` of each head (megatron's ``rotary_percent``).

Refused, naming the config field: what megatron computes otherwise (``norm_topk_prob=false``
with top-k > 1 or true at top-1, a group pick other than the top-2 sum,
``rope_interleave=false``, a scoring
other than sigmoid with bias, linear biases other than GLM's q/k/v ones, rope scalings other
than DeepSeek's YaRN). A multi-token prediction layer on the Hub (``num_nextn_predict_layers``,
layer ``num_hidden_layers`` of the weights) is left out of the import (:func:`mtp_layers`), as
transformers' classes leave it out on load.
"""

from __future__ import annotations

import math

from ckpt.hf.hf_weights import HFImportError
from recipes.families.gpt.hf_import import LLAMA_SIZE_FIELDS, rope_parameters
from recipes.families.moe.hf_table import moe_layers

CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
# megatron MLATransformerConfig's YaRN fields <- rope_parameters' keys
YARN = {"rotary_scaling_factor": "factor",
        "original_max_position_embeddings": "original_max_position_embeddings",
        "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim"}


def _refuse(field: str, value, valid: str) -> HFImportError:
    return HFImportError(f"config.json {field}={value!r}: {valid}")


def _routing(c) -> dict:
    experts, topk = int(c.n_routed_experts), int(c.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise _refuse("num_experts_per_tok", topk, f"between 1 and the {experts} experts")
    # megatron's sigmoid router renormalises the top-k weights at top-k > 1 only; transformers'
    # renormalises whenever norm_topk_prob (at top-1: every weight 1)
    norm = bool(getattr(c, "norm_topk_prob", True))
    if norm != (topk > 1):
        raise _refuse("norm_topk_prob", norm, f"megatron's sigmoid router renormalises the "
                                              f"top-k weights at num_experts_per_tok > 1 only "
                                              f"(here {topk}: only {topk > 1})")
    method = getattr(c, "topk_method", "noaux_tc")
    if method not in (None, "noaux_tc"):
        raise _refuse("topk_method", method, "only 'noaux_tc' (sigmoid scores with the expert "
                                             "bias)")
    if getattr(c, "scoring_func", "sigmoid") != "sigmoid":
        raise _refuse("scoring_func", c.scoring_func, "only 'sigmoid'")
    groups, group_topk = int(c.n_group or 1), int(c.topk_group or 1)
    if groups > 1:
        if experts % groups or not 1 <= group_topk <= groups:
            raise _refuse("n_group", groups, f"a divisor of n_routed_experts={experts} with "
                                             f"1 <= topk_group={group_topk} <= n_group")
        if topk // group_topk != 2:
            raise _refuse("topk_group", group_topk,
                          f"megatron picks groups by the sum of their top num_experts_per_tok "
                          f"// topk_group = {topk // group_topk} scores, DeepSeek's by the top "
                          f"2: only topk_group = num_experts_per_tok / 2 = {topk // 2} with "
                          f"n_group > 1")
    k = int(c.first_k_dense_replace or 0)
    if not 0 <= k < c.num_hidden_layers:
        raise _refuse("first_k_dense_replace", k, f"0 to num_hidden_layers - 1 = "
                                                  f"{c.num_hidden_layers - 1}")
    if int(getattr(c, "moe_layer_freq", 1) or 1) != 1:
        raise _refuse("moe_layer_freq", c.moe_layer_freq, "only 1 (every layer after the "
                                                          "first_k_dense_replace dense ones)")
    shared = int(c.n_shared_experts or 0)
    return {
        "num_moe_experts": experts, "moe_router_topk": topk, "moe_router_pre_softmax": False,
        "moe_ffn_hidden_size": int(c.moe_intermediate_size),
        "moe_shared_expert_intermediate_size": shared * int(c.moe_intermediate_size) or None,
        "moe_layer_freq": [0] * k + [1] * (c.num_hidden_layers - k) if k else 1,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": group_topk if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(c.routed_scaling_factor or 1.0),
        "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none",
    }


def _common(c, theta: float) -> dict:
    if c.hidden_act != "silu":
        raise _refuse("hidden_act", c.hidden_act, "only 'silu' (SwiGLU)")
    if getattr(c, "mlp_bias", False):
        raise _refuse("mlp_bias", True, "no MLP biases here (model.add_bias_linear=false)")
    if theta != int(theta):
        raise _refuse("rope_theta", theta, "model.rotary_base is an integer")
    return {
        "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "ffn_hidden_size": c.intermediate_size,
        "seq_length": c.max_position_embeddings, "swiglu": True, "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.rms_norm_eps), "add_bias_linear": False,
        "position_embedding_type": "rope", "rotary_base": int(theta),
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
        "mtp_num_layers": None,
    }


def deepseek_v3_fields(c) -> dict:
    """The ``model`` fields of a ``DeepseekV3Config`` ``c``.

    Raises:
        HFImportError: a setting megatron-core 0.19.2 computes otherwise (named).
    """
    if getattr(c, "attention_bias", False):
        raise _refuse("attention_bias", True, "multi-latent attention here has no biases")
    if not bool(getattr(c, "rope_interleave", True)):
        raise _refuse("rope_interleave", False, "megatron's multi-latent attention rotates the "
                                                "interleaved rope dims (only true)")
    rope = rope_parameters(c)
    kind = rope.get("rope_type", "default")
    fields = {"rope_type": "rope"}
    if kind == "yarn":
        fields = {"rope_type": "yarn", **{k: float(rope[v]) for k, v in YARN.items()
                                          if rope.get(v) is not None}}
        if "original_max_position_embeddings" in fields:
            fields["original_max_position_embeddings"] = int(
                fields["original_max_position_embeddings"])
        if rope.get("factor") is None:
            raise _refuse("rope_parameters.factor", None, "YaRN's factor (megatron's "
                                                          "rotary_scaling_factor) must be given")
        unequal = yarn_mscale_mismatch(float(rope["factor"]), rope.get("mscale"),
                                       rope.get("mscale_all_dim"))
        if unequal:
            raise _refuse("rope_parameters.mscale", rope.get("mscale"), unequal)
    elif kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "valid are 'default' and 'yarn'")
    q_lora = getattr(c, "q_lora_rank", None)
    return {
        **_common(c, float(rope.get("rope_theta", 10000.0))), **fields, **_routing(c),
        "num_query_groups": None, "kv_channels": None, "qk_layernorm": True,
        "add_qkv_bias": False, "rotary_percent": 1.0, "rope_scaling": False,
        "multi_latent_attention": True, "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(c.kv_lora_rank), "qk_head_dim": int(c.qk_nope_head_dim),
        "qk_pos_emb_head_dim": int(c.qk_rope_head_dim), "v_head_dim": int(c.v_head_dim),
    }


def glm4_moe_fields(c) -> dict:
    """The ``model`` fields of a ``Glm4MoeConfig`` ``c``.

    Raises:
        HFImportError: a setting megatron-core 0.19.2 computes otherwise (named).
    """
    rope = rope_parameters(c)
    if rope.get("rope_type", "default") != "default":
        raise _refuse("rope_parameters.rope_type", rope["rope_type"], "only 'default'")
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    partial = float(rope.get("partial_rotary_factor",
                             getattr(c, "partial_rotary_factor", 1.0)) or 1.0)
    return {
        **_common(c, float(rope.get("rope_theta", 10000.0))), **_routing(c),
        "num_query_groups": c.num_key_value_heads or heads,
        "kv_channels": None if head_dim * heads == c.hidden_size else head_dim,
        "qk_layernorm": bool(getattr(c, "use_qk_norm", False)),
        "add_qkv_bias": bool(getattr(c, "attention_bias", False)),
        "rotary_percent": partial, "rope_scaling": False,
    }


def _get_mscale(factor: float, mscale: float) -> float:
    # megatron's _yarn_get_mscale and transformers' yarn_get_mscale (the same formula)
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_mscale_mismatch(factor: float, mscale, mscale_all_dim) -> str | None:
    """Why transformers' YaRN attention factor differs from megatron's at these values (None:
    equal). megatron-core 0.19.2's ``YarnRotaryEmbedding`` scales cos/sin by
    ``get(factor, mscale) / get(factor, mscale_all_dim)`` (fields default 1.0 and 0.0);
    transformers' ``_compute_yarn_parameters`` by that only when both are given and non-zero,
    else by ``get(factor, 1)``. ``None`` values: absent from ``rope_parameters``."""
    ours = _get_mscale(factor, 1.0 if mscale is None else float(mscale)) / _get_mscale(
        factor, 0.0 if mscale_all_dim is None else float(mscale_all_dim))
    theirs = (_get_mscale(factor, float(mscale)) / _get_mscale(factor, float(mscale_all_dim))
              if mscale and mscale_all_dim else _get_mscale(factor, 1.0))
    if abs(ours - theirs) <= 1e-12 * abs(theirs):
        return None
    return (f"YaRN's cos/sin scale is {ours:.6g} in megatron, {theirs:.6g} in transformers "
            f"(mscale={mscale}, mscale_all_dim={mscale_all_dim}: transformers takes both only "
            f"when both are non-zero); valid: both non-zero, or mscale 1 and mscale_all_dim 0")


def mtp_layers(c) -> int:
    """``num_nextn_predict_layers`` of the config ``c``: the multi-token prediction layers that
    follow the decoder's in the Hub weights (DeepSeek-V3's layer 61, GLM-4.5's layer 92),
    which transformers ignores on load and the import leaves out.

    Raises:
        HFImportError: a value that is not an integer >= 0.
    """
    n = getattr(c, "num_nextn_predict_layers", 0) or 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise _refuse("num_nextn_predict_layers", n, "an integer >= 0")
    return n


def size_fields(kind: str) -> dict:
    """``{size key: config.json field}`` of ``kind`` (``"deepseek_v3"`` / ``"glm4_moe"``)."""
    out = {**LLAMA_SIZE_FIELDS, "experts": "n_routed_experts",
           "expert_ffn": "moe_intermediate_size",
           "shared_ffn": "n_shared_experts x moe_intermediate_size"}
    if kind == "glm4_moe":
        return out
    out.pop("groups", None)  # multi-latent attention has no query groups
    return {**out, "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank",
            "kv_down": "kv_lora_rank + qk_rope_head_dim",
            "q_head": "qk_nope_head_dim + qk_rope_head_dim",
            "kv_head": "qk_nope_head_dim + v_head_dim", "v_head": "v_head_dim"}


def sizes(m: dict) -> dict:
    """The size keys of :func:`size_fields` beyond the common ones, from the ``model`` dict
    (None: the model has no such part, e.g. no shared expert)."""
    out = {"shared_ffn": m.get("moe_shared_expert_intermediate_size") or None}
    if m.get("multi_latent_attention"):
        out.update(q_lora=m.get("q_lora_rank") or None, kv_lora=m["kv_lora_rank"],
                   kv_down=m["kv_lora_rank"] + m["qk_pos_emb_head_dim"],
                   q_head=m["qk_head_dim"] + m["qk_pos_emb_head_dim"],
                   kv_head=m["qk_head_dim"] + m["v_head_dim"], v_head=m["v_head_dim"])
    return out


def config(arch: str, m: dict, vocab: int, ids: dict):
    """The transformers config of the ``arch`` model (``"deepseek_v3"`` or ``"glm4_moe"``) from
    the ``model`` config ``m`` (the inverse of :func:`deepseek_v3_fields` /
    :func:`glm4_moe_fields`), the unpadded vocabulary size and the special token ids."""
    import transformers

    dense, _ = moe_layers(m)
    experts, width = int(m["num_moe_experts"]), int(m.get("moe_ffn_hidden_size")
                                                    or m["ffn_hidden_size"])
    shared = int(m.get("moe_shared_expert_intermediate_size") or 0)
    groups = m.get("moe_router_num_groups") or 1
    rope = {"rope_type": "default", "rope_theta": float(m.get("rotary_base", 10000))}
    common = dict(
        vocab_size=vocab, hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_attention_heads"], intermediate_size=m["ffn_hidden_size"],
        max_position_embeddings=m["seq_length"], rms_norm_eps=m.get("layernorm_epsilon", 1e-5),
        hidden_act="silu", tie_word_embeddings=bool(m.get("share_embeddings_and_output_weights")),
        n_routed_experts=experts, num_experts_per_tok=int(m["moe_router_topk"]),
        moe_intermediate_size=width, n_shared_experts=shared // width,
        first_k_dense_replace=len(dense), n_group=groups,
        topk_group=m.get("moe_router_group_topk") or 1,
        norm_topk_prob=int(m["moe_router_topk"]) > 1,  # megatron's sigmoid router: at top-k > 1
        routed_scaling_factor=float(m.get("moe_router_topk_scaling_factor") or 1.0),
        num_nextn_predict_layers=0, attention_dropout=0.0,
        architectures=[CLASSES[arch]], **ids)
    if arch == "glm4_moe":
        heads = m["num_attention_heads"]
        rope["partial_rotary_factor"] = float(m.get("rotary_percent", 1.0))
        return transformers.Glm4MoeConfig(
            num_key_value_heads=m.get("num_query_groups") or heads,
            head_dim=m.get("kv_channels") or m["hidden_size"] // heads,
            attention_bias=bool(m.get("add_qkv_bias")), use_qk_norm=bool(m.get("qk_layernorm")),
            rope_parameters=rope, **common)
    if m.get("rope_type", "yarn") == "yarn":
        rope.update({"rope_type": "yarn", **{v: m[k] for k, v in YARN.items()
                                             if m.get(k) is not None}})
    return transformers.DeepseekV3Config(
        num_key_value_heads=m["num_attention_heads"], q_lora_rank=m.get("q_lora_rank"),
        kv_lora_rank=m["kv_lora_rank"], qk_nope_head_dim=m["qk_head_dim"],
        qk_rope_head_dim=m["qk_pos_emb_head_dim"], v_head_dim=m["v_head_dim"],
        rope_interleave=True, attention_bias=False, rope_parameters=rope, **common)
