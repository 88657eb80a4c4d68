"""The GPT family read from Hugging Face (:mod:`ckpt.hf.hf_import` drives it): config.json -> the
``model`` config fields, and the config.json fields of the sizes :mod:`ckpt.hf.hf_weights` checks
(the weight names, both ways, and their sizes: :mod:`recipes.families.gpt.hf_table`).

* ``GPT2LMHeadModel`` -> GPT (LayerNorm, linear biases, GeLU, learned absolute positions).
  GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed. ``c_attn``'s ``[q | k | v]`` columns
  become megatron's fused per-head QKV rows. ``activation_function`` ``"gelu"`` is the exact erf
  GeLU, the published GPT-2's ``"gelu_new"`` its tanh approximation (``model.openai_gelu``).
* ``LlamaForCausalLM`` -> Llama family (RMSNorm, no bias, SwiGLU, RoPE, GQA). ``q/k/v_proj``
  become megatron's per-query-group fused rows (``SelfAttention.get_query_key_value_tensors``:
  per group its queries, its key, its value), ``[gate_proj; up_proj]`` is the gated fc1. RoPE
  scaling ``rope_type="llama3"`` maps to ``rope_scaling``/``rope_scaling_factor``; megatron-core
  0.19.2's ``RotaryEmbedding._apply_scaling`` fixes ``low_freq_factor=1``,
  ``high_freq_factor=4`` and ``original_max_position_embeddings=8192``, so other values are
  refused. An explicit ``head_dim`` is megatron's ``kv_channels``.
* The Llama architectures of other names: ``MistralForCausalLM`` (a ``sliding_window`` that
  never takes effect, null or at least ``max_position_embeddings``), ``Qwen2ForCausalLM``
  (biases on q/k/v only: megatron's ``add_qkv_bias``; no sliding window) and
  ``Qwen3ForCausalLM`` (an RMSNorm over each query and key head, ``q_norm``/``k_norm``:
  megatron's ``qk_layernorm``; no attention biases, no sliding window).
"""

from __future__ import annotations

from ckpt.hf.hf_weights import HFImportError

# megatron-core 0.19.2 RotaryEmbedding._apply_scaling's fixed Llama-3 parameters.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


# ------------------------------------------------------------------------------------------
# config.json -> model fields
# ------------------------------------------------------------------------------------------
def _refuse(field: str, value, valid: str) -> HFImportError:
    return HFImportError(f"config.json {field}={value!r}: {valid}")


def rope_parameters(config) -> dict:
    """``{"rope_type", "rope_theta", ...}`` of a transformers config (v5 ``rope_parameters``, or
    v4 ``rope_theta`` / ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_type", out.pop("type", "default"))
    return out


def _no_sliding_window(c) -> None:
    """Refuse a sliding-window attention megatron's model here does not compute (named)."""
    window = getattr(c, "sliding_window", None)
    if c.model_type in ("qwen2", "qwen3") and getattr(c, "use_sliding_window", False):
        raise _refuse("use_sliding_window", True, "megatron-core 0.19.2's attention here has no "
                                                  "sliding window; only false")
    if c.model_type == "mistral" and window is not None and window < c.max_position_embeddings:
        raise _refuse("sliding_window", window, f"megatron-core 0.19.2's attention here has no "
                                                f"sliding window: only null or at least "
                                                f"max_position_embeddings="
                                                f"{c.max_position_embeddings}")


def llama_fields(c) -> dict:
    """The ``model`` fields of a ``LlamaConfig`` ``c``, or of the Llama architectures of other
    names (``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``).

    Raises:
        HFImportError: a setting megatron's Llama-family model here does not compute (named).
    """
    heads, hidden = c.num_attention_heads, c.hidden_size
    if c.hidden_act != "silu":
        raise _refuse("hidden_act", c.hidden_act, "the Llama family is imported with 'silu' "
                                                  "(SwiGLU) only")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(c, name, False):
            raise _refuse(name, True, "megatron's Llama-family model here has no linear biases "
                                      "(model.add_bias_linear=false)")
    _no_sliding_window(c)
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    rope = rope_parameters(c)
    theta = float(rope.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise _refuse("rope_theta", theta, "model.rotary_base is an integer")
    fields = {"rope_scaling": False, "rope_scaling_factor": 8.0}
    kind = rope.get("rope_type", "default")
    if kind == "llama3":
        for key, want in MEGATRON_LLAMA3_ROPE.items():
            if float(rope.get(key, want)) != want:
                raise _refuse(f"rope_parameters.{key}", rope.get(key),
                              f"megatron-core's Llama-3 RoPE scaling fixes it to {want}")
        fields = {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    elif kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "valid are 'default' and 'llama3'")
    if float(getattr(c, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", c.partial_rotary_factor, "only 1.0")
    groups = getattr(c, "num_key_value_heads", None) or heads
    return {
        "num_layers": c.num_hidden_layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": groups, "ffn_hidden_size": c.intermediate_size,
        "seq_length": c.max_position_embeddings, "swiglu": True, "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.rms_norm_eps), "add_bias_linear": False,
        "add_qkv_bias": c.model_type == "qwen2", "qk_layernorm": c.model_type == "qwen3",
        "kv_channels": None if head_dim * heads == hidden else head_dim,
        "position_embedding_type": "rope", "rotary_base": int(theta), "rotary_percent": 1.0,
        **fields,
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
    }


def gpt2_fields(c) -> dict:
    """The ``model`` fields of a ``GPT2Config`` ``c``.

    Raises:
        HFImportError: a setting megatron's GPT model does not compute (named).
    """
    if c.activation_function not in ("gelu", "gelu_new"):
        raise _refuse("activation_function", c.activation_function,
                      "valid are 'gelu' (the exact erf GeLU) and 'gelu_new' (its tanh "
                      "approximation, model.openai_gelu)")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if bool(getattr(c, name, want)) != want:
            raise _refuse(name, getattr(c, name), f"only {want} (megatron's attention scales by "
                                                  f"1/sqrt(head_dim))")
    return {
        "num_layers": c.n_layer, "hidden_size": c.n_embd, "num_attention_heads": c.n_head,
        "num_query_groups": None, "ffn_hidden_size": c.n_inner or 4 * c.n_embd,
        "seq_length": c.n_positions, "swiglu": False, "normalization": "LayerNorm",
        "openai_gelu": c.activation_function == "gelu_new",
        "layernorm_epsilon": float(c.layer_norm_epsilon), "add_bias_linear": True,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
    }


# ------------------------------------------------------------------------------------------
# config.json fields of the sizes checked (ckpt.hf.hf_weights.check_sizes)
# ------------------------------------------------------------------------------------------
# config.json field names (as the transformers config class names them) of each model size.
GPT2_SIZE_FIELDS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "n_inner",
                    "vocab": "vocab_size", "positions": "n_positions"}
LLAMA_SIZE_FIELDS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
                     "heads": "num_attention_heads", "groups": "num_key_value_heads",
                     "ffn": "intermediate_size", "vocab": "vocab_size"}
