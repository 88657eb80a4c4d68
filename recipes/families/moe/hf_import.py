"""The MoE family read from Hugging Face (:mod:`ckpt.hf.hf_import` drives it): ``MixtralForCausalLM``
and ``Qwen3MoeForCausalLM`` config.json -> the ``model`` config fields and the config.json fields
of the sizes :mod:`ckpt.hf.hf_weights` checks; the inverse of
:func:`recipes.families.moe.formats.config`. The weight names, both ways (the Hub's per-expert
form that ``save_pretrained`` writes), and their sizes: :mod:`recipes.families.moe.hf_table`.

Attention, norms, embeddings and RoPE are read as for Llama
(:func:`recipes.families.gpt.hf_import.llama_fields`); the MLP of every layer is megatron's MoE
layer.

Fields (megatron's names): ``num_local_experts`` / ``num_experts`` -> ``num_moe_experts``,
``num_experts_per_tok`` -> ``moe_router_topk``, the expert width (Mixtral
``intermediate_size``, Qwen3-MoE ``moe_intermediate_size``) -> ``moe_ffn_hidden_size``,
``router_aux_loss_coef`` -> ``moe_aux_loss_coeff``, Qwen3-MoE ``norm_topk_prob`` -> ``not
moe_router_pre_softmax`` (megatron renormalises the top-k weights unless it takes the softmax
first) and its q/k norms -> ``qk_layernorm``.

Refused, naming the config field: what megatron-core 0.19.2 (or this project's model config)
cannot express exactly, and what it can but whose import is not written yet (each named with
megatron's field): Qwen3-MoE ``decoder_sparse_step`` != 1 and ``mlp_only_layers`` (dense
layers among the MoE ones: ``moe_layer_freq``), a shared expert
(``moe_shared_expert_intermediate_size``), DeepSeek-V3's routing carried by a config
(``scoring_func``, ``topk_method``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
``first_k_dense_replace``), a sliding window that takes effect, Mixtral's
``router_jitter_noise`` (no ``moe_input_jitter_eps`` field here), top-1 routing with
renormalisation (megatron requires the pre-softmax at top-1), a top-k above the expert count,
and RoPE scaling (the MoE export refuses it too).
"""

from __future__ import annotations

from ckpt.hf.hf_weights import HFImportError
from recipes.families.gpt.hf_import import LLAMA_SIZE_FIELDS, llama_fields


def _refuse(field: str, value, valid: str) -> HFImportError:
    return HFImportError(f"config.json {field}={value!r}: {valid}")


# DeepSeek-V3-style settings a config may carry, with the value Mixtral / Qwen3-MoE routing
# has and megatron's field that computes them: refused, naming both (the import mapping of
# DeepseekV3 / Glm4Moe is not written yet).
_NOT_YET = (
    ("scoring_func", ("softmax",), "moe_router_score_function"),
    ("topk_method", ("greedy",), "moe_router_enable_expert_bias"),
    ("n_group", (1,), "moe_router_num_groups"),
    ("topk_group", (1,), "moe_router_group_topk"),
    ("routed_scaling_factor", (1, 1.0), "moe_router_topk_scaling_factor"),
    ("first_k_dense_replace", (0,), "moe_layer_freq (a 0/1 list)"),
    ("moe_layer_freq", (1,), "moe_layer_freq"),
)


def moe_fields(c) -> dict:
    """The ``model`` fields of a ``MixtralConfig`` or ``Qwen3MoeConfig`` ``c`` (megatron names).

    Raises:
        HFImportError: a setting megatron-core 0.19.2's MoE model here does not compute exactly
            (names the config field, its value and what is importable).
    """
    kind = c.model_type
    for name, plain, field in _NOT_YET:
        value = getattr(c, name, None)
        if value is not None and value not in plain:
            raise _refuse(name, value, f"megatron's {field} is a model field here, but its "
                                       f"import is not written yet (only {plain[0]!r}, or absent)")
    if kind == "qwen3_moe":
        if int(getattr(c, "decoder_sparse_step", 1)) != 1:
            raise _refuse("decoder_sparse_step", c.decoder_sparse_step,
                          "only 1 (every layer MoE; megatron's moe_layer_freq, an int or a 0/1 "
                          "list, is a model field here, but its import is not written yet)")
        if list(getattr(c, "mlp_only_layers", None) or []):
            raise _refuse("mlp_only_layers", c.mlp_only_layers,
                          "only [] (dense layers among the MoE ones: megatron's moe_layer_freq "
                          "as a 0/1 list is a model field here, but its import is not written "
                          "yet)")
        if getattr(c, "use_sliding_window", False):
            raise _refuse("use_sliding_window", True, "megatron-core 0.19.2's attention here "
                                                      "has no sliding window; only false")
    else:
        window = getattr(c, "sliding_window", None)
        if window is not None and window < c.max_position_embeddings:
            raise _refuse("sliding_window", window, f"megatron-core 0.19.2's attention here has "
                                                    f"no sliding window: only null or at least "
                                                    f"max_position_embeddings="
                                                    f"{c.max_position_embeddings}")
        if float(getattr(c, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise _refuse("router_jitter_noise", c.router_jitter_noise,
                          "only 0 (megatron's moe_input_jitter_eps is not a model field here)")
    for name in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if getattr(c, name, None):
            raise _refuse(name, getattr(c, name), "shared experts (megatron's "
                                                  "moe_shared_expert_intermediate_size) are not "
                                                  "imported yet (only 0)")
    fields = llama_fields(c)  # attention, norms, RoPE; refuses biases and other activations
    if fields["rope_scaling"]:
        raise _refuse("rope_parameters.rope_type", "llama3", "MoE models are imported without "
                                                             "RoPE scaling ('default' only)")
    experts = int(c.num_local_experts if kind == "mixtral" else c.num_experts)
    topk = int(c.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise _refuse("num_experts_per_tok", topk, f"between 1 and the {experts} experts")
    pre_softmax = kind == "qwen3_moe" and not bool(c.norm_topk_prob)
    if topk == 1 and not pre_softmax:
        field = "num_experts_per_tok" if kind == "mixtral" else "norm_topk_prob"
        raise _refuse(field, getattr(c, field), "top-1 routing with renormalised weights: "
                                                "megatron requires moe_router_pre_softmax at "
                                                "top-1, which does not renormalise")
    width = c.intermediate_size if kind == "mixtral" else c.moe_intermediate_size
    fields.update({
        "qk_layernorm": kind == "qwen3_moe", "add_qkv_bias": False,
        "num_moe_experts": experts, "moe_router_topk": topk,
        "moe_router_pre_softmax": pre_softmax, "moe_ffn_hidden_size": int(width),
        "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1,
        "moe_aux_loss_coeff": float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0),
    })
    return fields


def size_fields(kind: str) -> dict:
    """``{size key: config.json field}`` of ``kind`` (Llama's, with ``experts`` and
    ``expert_ffn``)."""
    if kind == "mixtral":
        return {**LLAMA_SIZE_FIELDS, "experts": "num_local_experts",
                "expert_ffn": "intermediate_size"}
    # transformers >= 5 saves num_local_experts (num_experts: its alias, older configs' name)
    return {**LLAMA_SIZE_FIELDS, "experts": "num_local_experts (num_experts)",
            "expert_ffn": "moe_intermediate_size"}
