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
  Mistral import comes back as the ``LlamaForCausalLM`` that computes it). Its
  attention and the tensors outside the layers are shared by the MoE family's classes
  (:mod:`recipes.families.moe.formats`).

The fused QKV weight is megatron's per-query-group layout (``SelfAttention.get_query_key_value_tensors``):
rows ``[groups, (heads_per_group + 2) * head_dim]`` with each group's queries, then its key, then
its value. SwiGLU's fc1 rows are gate then up (megatron's ``gated_linear_unit``). The padded
vocabulary rows (``make_vocab_size_divisible_by``) are not exported.
"""

from __future__ import annotations

from typing import Any

from ckpt.families import ExportError
from recipes.families.gpt.hf_import import MEGATRON_LLAMA3_ROPE


def split_qkv(w, heads: int, groups: int, head_dim: int):
    """Megatron's fused QKV rows ``[groups * (heads/groups + 2) * head_dim, ...]`` -> (q, k, v)
    with rows ``[heads * head_dim]``, ``[groups * head_dim]``, ``[groups * head_dim]``."""
    per = heads // groups
    g = w.reshape(groups, (per + 2) * head_dim, *w.shape[1:])
    q = g[:, : per * head_dim].reshape(heads * head_dim, *w.shape[1:])
    k = g[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, *w.shape[1:])
    v = g[:, (per + 1) * head_dim:].reshape(groups * head_dim, *w.shape[1:])
    return q, k, v


def architecture(model: dict) -> str | None:
    """``"gpt2"``, ``"llama"``, ``"qwen2"`` or ``"qwen3"`` for a recorded ``model`` config dict of
    the GPT family (``ckpt.families.for_export`` asks the family the model names).

    Raises:
        ExportError: a combination no transformers class computes exactly (named).
    """
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


def gpt2_build(t: dict, m: dict, vocab: int, ids: dict) -> tuple[Any, dict]:
    """(``GPT2Config``, state dict) of a GPT model from its full logical tensors ``t``
    (per-layer tensors stacked along dim 0), its recorded model config ``m``, the unpadded
    vocabulary size and the special token ids; Conv1D weights are the transposed megatron ones,
    ``c_attn`` the per-head QKV rows as ``[q | k | v]`` columns."""
    from transformers import GPT2Config

    h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_layers"]
    shared = bool(m.get("share_embeddings_and_output_weights", False))
    config = GPT2Config(
        vocab_size=vocab, n_positions=m["seq_length"], n_embd=h, n_layer=layers, n_head=heads,
        n_inner=m["ffn_hidden_size"],
        activation_function="gelu_new" if m.get("openai_gelu") else "gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=m.get("layernorm_epsilon", 1e-5), tie_word_embeddings=shared,
        architectures=["GPT2LMHeadModel"], **ids,
    )
    d = h // heads
    L = "decoder.layers."
    sd = {
        "transformer.wte.weight": t["embedding.word_embeddings.weight"][:vocab],
        "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": t["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": t["decoder.final_layernorm.bias"],
    }
    if not shared:
        sd["lm_head.weight"] = t["output_layer.weight"][:vocab]
    for i in range(layers):
        p = f"transformer.h.{i}."
        qkv_w = _cat(split_qkv(t[L + "self_attention.linear_qkv.weight"][i], heads, heads, d))
        qkv_b = _cat(split_qkv(t[L + "self_attention.linear_qkv.bias"][i], heads, heads, d))
        sd.update({
            p + "ln_1.weight": t[L + "self_attention.linear_qkv.layer_norm_weight"][i],
            p + "ln_1.bias": t[L + "self_attention.linear_qkv.layer_norm_bias"][i],
            p + "attn.c_attn.weight": qkv_w.t(),
            p + "attn.c_attn.bias": qkv_b,
            p + "attn.c_proj.weight": t[L + "self_attention.linear_proj.weight"][i].t(),
            p + "attn.c_proj.bias": t[L + "self_attention.linear_proj.bias"][i],
            p + "ln_2.weight": t[L + "mlp.linear_fc1.layer_norm_weight"][i],
            p + "ln_2.bias": t[L + "mlp.linear_fc1.layer_norm_bias"][i],
            p + "mlp.c_fc.weight": t[L + "mlp.linear_fc1.weight"][i].t(),
            p + "mlp.c_fc.bias": t[L + "mlp.linear_fc1.bias"][i],
            p + "mlp.c_proj.weight": t[L + "mlp.linear_fc2.weight"][i].t(),
            p + "mlp.c_proj.bias": t[L + "mlp.linear_fc2.bias"][i],
        })
    return config, sd


def _cat(parts):
    """Rows of ``parts`` one after another (dim 0)."""
    import torch

    return torch.cat(parts, dim=0)


def llama_build(t: dict, m: dict, vocab: int, ids: dict) -> tuple[Any, dict]:
    """(``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config`` per :func:`_llama_kind`, state dict)
    of a Llama-family model from its full logical tensors ``t`` (per-layer tensors stacked along
    dim 0), its recorded model config ``m``, the unpadded vocabulary size and the special token
    ids; SwiGLU's fc1 rows split into gate then up."""
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
    ffn = m["ffn_hidden_size"]
    shared = bool(m.get("share_embeddings_and_output_weights", False))
    config = getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=groups,
        **({} if kind == "qwen2" and d * heads == h else {"head_dim": d}),
        max_position_embeddings=m["seq_length"], rms_norm_eps=m.get("layernorm_epsilon", 1e-5),
        rope_theta=float(m.get("rotary_base", 10000)), hidden_act="silu",
        tie_word_embeddings=shared, architectures=[name], **extra, **ids, **rope_scaling(m),
    )
    L = "decoder.layers."
    sd = llama_ends(t, vocab, shared)
    for i in range(layers):
        p = f"model.layers.{i}."
        fc1 = t[L + "mlp.linear_fc1.weight"][i]
        sd.update(llama_attention(t, m, i, p))
        sd.update({
            p + "post_attention_layernorm.weight": t[L + "mlp.linear_fc1.layer_norm_weight"][i],
            p + "mlp.gate_proj.weight": fc1[:ffn],
            p + "mlp.up_proj.weight": fc1[ffn:],
            p + "mlp.down_proj.weight": t[L + "mlp.linear_fc2.weight"][i],
        })
    return config, sd


def llama_ends(t: dict, vocab: int, shared: bool) -> dict:
    """The Llama-family tensors outside the layers: ``model.embed_tokens`` (vocab, hidden) and,
    unless the output weight is the embedding's (``shared``), ``lm_head`` (vocab, hidden), each
    without megatron's padded vocabulary rows, and ``model.norm`` (hidden,)."""
    sd = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:vocab],
          "model.norm.weight": t["decoder.final_layernorm.weight"]}
    if not shared:
        sd["lm_head.weight"] = t["output_layer.weight"][:vocab]
    return sd


def llama_attention(t: dict, m: dict, i: int, p: str) -> dict:
    """Layer ``i``'s input norm and attention of a Llama-family model (also Mixtral's and
    Qwen3-MoE's) under the transformers prefix ``p`` (``model.layers.<i>.``): the fused QKV
    split per query group (:func:`split_qkv`), ``linear_proj`` as ``o_proj``."""
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    d = m.get("kv_channels") or m["hidden_size"] // heads
    L = "decoder.layers."
    q, k, v = split_qkv(t[L + "self_attention.linear_qkv.weight"][i], heads, groups, d)
    out = {
        p + "input_layernorm.weight": t[L + "self_attention.linear_qkv.layer_norm_weight"][i],
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": t[L + "self_attention.linear_proj.weight"][i],
    }
    if m.get("add_qkv_bias"):  # Qwen2
        q, k, v = split_qkv(t[L + "self_attention.linear_qkv.bias"][i], heads, groups, d)
        out.update({p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": k,
                    p + "self_attn.v_proj.bias": v})
    if m.get("qk_layernorm"):  # Qwen3 (and Qwen3-MoE)
        out.update({p + "self_attn.q_norm.weight": t[L + "self_attention.q_layernorm.weight"][i],
                    p + "self_attn.k_norm.weight": t[L + "self_attention.k_layernorm.weight"][i]})
    return out


def rope_scaling(m: dict) -> dict:
    """``rope_scaling`` of a LlamaConfig: megatron's Llama-3 scaling (``model.rope_scaling``,
    ``rope_scaling_factor``; megatron-core 0.19.2 ``RotaryEmbedding._apply_scaling`` fixes the
    other three parameters), or none."""
    if not m.get("rope_scaling", False):
        return {}
    factor = float(m.get("rope_scaling_factor", 8.0))
    return {"rope_scaling": {"rope_type": "llama3", "factor": factor, **MEGATRON_LLAMA3_ROPE}}
