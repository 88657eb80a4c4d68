"""The GPT family read from Hugging Face (:mod:`ckpt.hf.hf_import` drives it): config.json -> the
``model`` config fields, the weight plan, and the sizes :mod:`ckpt.hf.hf_weights` checks.

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


def _rope(config) -> dict:
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
    rope = _rope(c)
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
# safetensors -> megatron tensors
# ------------------------------------------------------------------------------------------
def fuse_qkv(q, k, v, groups: int):
    """HF's q ``[heads*d, ...]``, k, v ``[groups*d, ...]`` -> megatron's fused rows
    ``[groups * (heads/groups + 2) * d, ...]`` (per group: its queries, its key, its value)."""
    import torch

    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _output(m: dict) -> list:
    """The output layer's entry, none when it is the embedding (HF's ``lm_head`` lies outside
    the base model's prefix)."""
    if m["share_embeddings_and_output_weights"]:
        return []
    return [("output_layer.weight", ["lm_head.weight"], False, lambda t: t[0])]


def gpt2_plan(m: dict, prefix: str) -> list:
    """Every megatron tensor of a GPT-2 import: ``[(megatron key, [HF names, "{i}" the layer],
    per_layer, fn(list of tensors) -> tensor)]`` (fn gives one layer's tensor, e.g. the fused
    QKV ``[3h, h]`` of ``c_attn`` ``[h, 3h]``)."""
    heads, h = m["num_attention_heads"], m["hidden_size"]

    def qkv(t):
        w = t[0].t() if t[0].dim() == 2 else t[0]  # Conv1D [in, 3h] -> [3h, in]
        q, k, v = w.split(h, dim=0)
        return fuse_qkv(q, k, v, heads)

    T = lambda t: t[0].t()  # noqa: E731 - Conv1D weight [in, out] -> Linear [out, in]
    I = lambda t: t[0]  # noqa: E731
    p, L = prefix, "decoder.layers."
    plan = [
        ("embedding.word_embeddings.weight", [p + "wte.weight"], False, I),
        ("embedding.position_embeddings.weight", [p + "wpe.weight"], False, I),
        ("decoder.final_layernorm.weight", [p + "ln_f.weight"], False, I),
        ("decoder.final_layernorm.bias", [p + "ln_f.bias"], False, I),
    ]
    h_ = p + "h.{i}."
    plan += [
        (L + "self_attention.linear_qkv.layer_norm_weight", [h_ + "ln_1.weight"], True, I),
        (L + "self_attention.linear_qkv.layer_norm_bias", [h_ + "ln_1.bias"], True, I),
        (L + "self_attention.linear_qkv.weight", [h_ + "attn.c_attn.weight"], True, qkv),
        (L + "self_attention.linear_qkv.bias", [h_ + "attn.c_attn.bias"], True, qkv),
        (L + "self_attention.linear_proj.weight", [h_ + "attn.c_proj.weight"], True, T),
        (L + "self_attention.linear_proj.bias", [h_ + "attn.c_proj.bias"], True, I),
        (L + "mlp.linear_fc1.layer_norm_weight", [h_ + "ln_2.weight"], True, I),
        (L + "mlp.linear_fc1.layer_norm_bias", [h_ + "ln_2.bias"], True, I),
        (L + "mlp.linear_fc1.weight", [h_ + "mlp.c_fc.weight"], True, T),
        (L + "mlp.linear_fc1.bias", [h_ + "mlp.c_fc.bias"], True, I),
        (L + "mlp.linear_fc2.weight", [h_ + "mlp.c_proj.weight"], True, T),
        (L + "mlp.linear_fc2.bias", [h_ + "mlp.c_proj.bias"], True, I),
    ]
    return plan + _output(m)


def llama_plan(m: dict, prefix: str) -> list:
    """Every megatron tensor of a Llama import, entries as :func:`gpt2_plan`'s (q/k/v and their
    biases fused per query group, ``[gate; up]`` the gated fc1 ``[2 * ffn, h]``; Qwen3's q/k
    norms as megatron's ``q_layernorm``/``k_layernorm``)."""
    import torch

    groups = m["num_query_groups"]
    I = lambda t: t[0]  # noqa: E731
    L, h_ = "decoder.layers.", prefix + "layers.{i}."
    a = h_ + "self_attn."
    return [
        ("embedding.word_embeddings.weight", [prefix + "embed_tokens.weight"], False, I),
        ("decoder.final_layernorm.weight", [prefix + "norm.weight"], False, I),
        (L + "self_attention.linear_qkv.layer_norm_weight", [h_ + "input_layernorm.weight"],
         True, I),
        (L + "self_attention.linear_qkv.weight",
         [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], True,
         lambda t: fuse_qkv(*t, groups)),
    ] + ([
        (L + "self_attention.linear_qkv.bias",
         [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], True,
         lambda t: fuse_qkv(*t, groups)),
    ] if m.get("add_qkv_bias") else []) + ([
        (L + "self_attention.q_layernorm.weight", [a + "q_norm.weight"], True, I),
        (L + "self_attention.k_layernorm.weight", [a + "k_norm.weight"], True, I),
    ] if m.get("qk_layernorm") else []) + [
        (L + "self_attention.linear_proj.weight", [a + "o_proj.weight"], True, I),
        (L + "mlp.linear_fc1.layer_norm_weight", [h_ + "post_attention_layernorm.weight"],
         True, I),
        (L + "mlp.linear_fc1.weight", [h_ + "mlp.gate_proj.weight", h_ + "mlp.up_proj.weight"],
         True, lambda t: torch.cat(t, dim=0)),
        (L + "mlp.linear_fc2.weight", [h_ + "mlp.down_proj.weight"], True, I),
    ] + _output(m)


# ------------------------------------------------------------------------------------------
# sizes checked against config.json (ckpt.hf.hf_weights.check_sizes)
# ------------------------------------------------------------------------------------------
# config.json field names (as the transformers config class names them) of each model size.
GPT2_SIZE_FIELDS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "n_inner",
                    "vocab": "vocab_size", "positions": "n_positions"}
LLAMA_SIZE_FIELDS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
                     "heads": "num_attention_heads", "groups": "num_key_value_heads",
                     "ffn": "intermediate_size", "vocab": "vocab_size"}
_H, _F, _V = ("hidden", 1), ("ffn", 1), ("vocab", 1)


def _with_head(out: dict, tied: bool) -> dict:
    return out if tied else {**out, "lm_head.weight": (_V, _H)}


def gpt2_sizes(tied: bool) -> dict:
    """``{HF name without prefix ("{i}": a layer): ((size key, factor), ...)}`` of GPT-2."""
    h, f, v = _H, _F, _V
    out = {"wte.weight": (v, h), "wpe.weight": (("positions", 1), h), "ln_f.weight": (h,),
           "ln_f.bias": (h,)}
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, ("hidden", 3)),
             "attn.c_attn.bias": (("hidden", 3),), "attn.c_proj.weight": (h, h),
             "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h),
             "mlp.c_proj.bias": (h,)}
    out.update({f"h.{{i}}.{k}": dims for k, dims in layer.items()})
    return _with_head(out, tied)


def llama_sizes(tied: bool) -> dict:
    """As :func:`gpt2_sizes`, of Llama (q rows: heads times ``head_dim``; k/v rows: query
    groups times ``head_dim``), with Qwen2's q/k/v biases and Qwen3's q/k norms (checked
    where the weights hold them)."""
    h, f, v, g, q = _H, _F, _V, ("groups", "head_dim"), ("heads", "head_dim")
    out = {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
             "self_attn.k_proj.weight": (g, h), "self_attn.v_proj.weight": (g, h),
             "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (g,),
             "self_attn.v_proj.bias": (g,), "self_attn.q_norm.weight": (("head_dim", 1),),
             "self_attn.k_norm.weight": (("head_dim", 1),),
             "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f)}
    out.update({f"layers.{{i}}.{k}": dims for k, dims in layer.items()})
    return _with_head(out, tied)
