"""The GPT family written as Hugging Face models (:mod:`ckpt.hf.hf_export` drives it), from
megatron-core's GPTModel tensors (local layer spec; per-layer tensors stacked along dim 0,
``[num_layers, ...]``):

* **GPT** (LayerNorm, linear biases, GeLU MLP, learned absolute positions) -> ``GPT2LMHeadModel``
  with ``activation_function`` ``"gelu"`` (the exact erf GeLU) or, with ``model.openai_gelu``,
  ``"gelu_new"`` (its tanh approximation), ``n_inner = ffn_hidden_size``, ``layer_norm_epsilon`` 1e-5 (megatron's
  ``layernorm_epsilon``), ``tie_word_embeddings`` as ``share_embeddings_and_output_weights``.
  GPT-2's Conv1D weights are the transposed megatron weights.
* **Llama family** (RMSNorm, no linear bias, SwiGLU, RoPE) -> ``LlamaForCausalLM``, from the
  model config fields ``normalization``, ``add_bias_linear``, ``num_query_groups``,
  ``kv_channels``, ``rotary_base`` and ``layernorm_epsilon`` when the run recorded them; with
  ``add_qkv_bias`` -> ``Qwen2ForCausalLM``, with ``qk_layernorm`` -> ``Qwen3ForCausalLM`` (a
  Mistral import comes back as the ``LlamaForCausalLM`` that computes it).

This module writes the transformers configs; the state dicts come from the architectures'
weight tables (:mod:`recipes.families.gpt.hf_table`, :func:`ckpt.hf.mapping.state_dict`):
the fused QKV weight split per query group, SwiGLU's fc1 rows gate then up, the padded
vocabulary rows (``make_vocab_size_divisible_by``) not exported.
"""

from __future__ import annotations

from typing import Any

from ckpt.families import ExportError
from recipes.families.gpt.hf_import import MEGATRON_LLAMA3_ROPE


def architecture(model: dict) -> str | None:
    """``"gpt2"``, ``"llama"``, ``"qwen2"`` or ``"qwen3"`` for a recorded ``model`` config dict of
    the GPT family (``ckpt.families.for_export`` asks the family the model names).

    Raises:
        ExportError: a combination no transformers class computes exactly (named).
    """
    if model.get("multi_latent_attention"):
        raise ExportError("model.multi_latent_attention=True without routed experts: no "
                          "transformers class computes a dense multi-latent attention model "
                          "(DeepseekV3ForCausalLM: an MoE model, model.family=moe)")
    norm = model.get("normalization", "LayerNorm")
    bias = model.get("add_bias_linear", True)
    pos = model.get("position_embedding_type", "learned_absolute")
    swiglu = bool(model.get("swiglu", False))
    if norm == "LayerNorm" and bias and pos == "learned_absolute" and not swiglu:
        if model.get("qk_layernorm") or model.get("add_qkv_bias"):
            raise ExportError("model.qk_layernorm / add_qkv_bias: GPT2LMHeadModel has neither "
                              "(Qwen3ForCausalLM / Qwen2ForCausalLM: RMSNorm, rope, SwiGLU models)")
        groups = model.get("num_query_groups")
        if groups not in (None, model["num_attention_heads"]):
            raise ExportError(f"model.num_query_groups={groups}: GPT2LMHeadModel has no grouped "
                              f"query attention")
        return "gpt2"
    if norm == "RMSNorm" and not bias and pos == "rope" and swiglu:
        if float(model.get("rotary_percent", 1.0)) != 1.0:
            raise ExportError(
                f"model.rotary_percent={model.get('rotary_percent', 1.0)}: only RoPE over the "
                f"whole head (rotary_percent=1.0) is exported")
        return _llama_kind(model)
    raise ExportError(
        f"no transformers class computes this model exactly: normalization={norm!r}, "
        f"add_bias_linear={bias}, position_embedding_type={pos!r}, swiglu={swiglu}; exportable "
        f"are GPT (LayerNorm, bias, learned_absolute, GeLU) -> GPT2LMHeadModel and Llama "
        f"(RMSNorm, no bias, rope, SwiGLU) -> LlamaForCausalLM")


def _llama_kind(model: dict) -> str:
    """The transformers Llama architecture of a Llama-family ``model`` dict."""
    if model.get("qk_layernorm") and model.get("add_qkv_bias"):
        raise ExportError("model.qk_layernorm=True with add_qkv_bias=True: no transformers class "
                          "has both (Qwen3: q/k norms, Qwen2: q/k/v biases)")
    return "qwen3" if model.get("qk_layernorm") else "qwen2" if model.get("add_qkv_bias") else "llama"


def gpt2_config(m: dict, vocab: int, ids: dict) -> Any:
    """The ``GPT2Config`` of a GPT model from its recorded model config ``m``, the unpadded
    vocabulary size and the special token ids (no dropout)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab, n_positions=m["seq_length"], n_embd=m["hidden_size"],
        n_layer=m["num_layers"], n_head=m["num_attention_heads"], n_inner=m["ffn_hidden_size"],
        activation_function="gelu_new" if m.get("openai_gelu") else "gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=m.get("layernorm_epsilon", 1e-5),
        tie_word_embeddings=bool(m.get("share_embeddings_and_output_weights", False)),
        architectures=["GPT2LMHeadModel"], **ids,
    )


def llama_config(m: dict, vocab: int, ids: dict) -> Any:
    """The ``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config`` (per :func:`_llama_kind`) of a
    Llama-family model from its recorded model config ``m``, the unpadded vocabulary size and
    the special token ids."""
    import transformers

    kind = _llama_kind(m)
    cls, name, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
        # Qwen2's config has no head_dim field: hidden / heads unless the model set another.
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"attention_bias": False,
                                                      "use_sliding_window": False}),
    }[kind]
    h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_layers"]
    groups = m.get("num_query_groups") or heads
    d = m.get("kv_channels") or h // heads
    return getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=h, intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=groups,
        **({} if kind == "qwen2" and d * heads == h else {"head_dim": d}),
        max_position_embeddings=m["seq_length"], rms_norm_eps=m.get("layernorm_epsilon", 1e-5),
        rope_theta=float(m.get("rotary_base", 10000)), hidden_act="silu",
        tie_word_embeddings=bool(m.get("share_embeddings_and_output_weights", False)),
        architectures=[name], **extra, **ids, **rope_scaling(m),
    )


def rope_scaling(m: dict) -> dict:
    """``rope_scaling`` of a LlamaConfig: megatron's Llama-3 scaling (``model.rope_scaling``,
    ``rope_scaling_factor``; megatron-core 0.19.2 ``RotaryEmbedding._apply_scaling`` fixes the
    other three parameters), or none."""
    if not m.get("rope_scaling", False):
        return {}
    factor = float(m.get("rope_scaling_factor", 8.0))
    return {"rope_scaling": {"rope_type": "llama3", "factor": factor, **MEGATRON_LLAMA3_ROPE}}
