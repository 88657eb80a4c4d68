"""The Llama family in transformers' names: megatron's GPTModel tensors (RMSNorm, no linear bias,
SwiGLU, RoPE, grouped query attention) -> ``LlamaForCausalLM``. The attention and the tensors
outside the layers are shared by the MoE classes (:mod:`gtp.hf_export_moe`); the dispatch, the
output directory and the tokenizer are :mod:`gtp.hf_export`'s.
"""

from __future__ import annotations

from typing import Any


class ExportError(ValueError):
    """The checkpoint cannot be exported (names what is missing or which architecture)."""


def split_qkv(w, heads: int, groups: int, head_dim: int):
    """Megatron's fused QKV rows ``[groups * (heads/groups + 2) * head_dim, ...]`` -> (q, k, v)
    with rows ``[heads * head_dim]``, ``[groups * head_dim]``, ``[groups * head_dim]``."""
    per = heads // groups
    g = w.reshape(groups, (per + 2) * head_dim, *w.shape[1:])
    q = g[:, : per * head_dim].reshape(heads * head_dim, *w.shape[1:])
    k = g[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, *w.shape[1:])
    v = g[:, (per + 1) * head_dim:].reshape(groups * head_dim, *w.shape[1:])
    return q, k, v


def build(t: dict, m: dict, vocab: int, ids: dict) -> tuple[Any, dict]:
    """(``LlamaConfig``, state dict) of a Llama-family model from its full logical tensors ``t``
    (per-layer tensors stacked along dim 0), its recorded model config ``m``, the unpadded
    vocabulary size and the special token ids; SwiGLU's fc1 rows split into gate then up."""
    from transformers import LlamaConfig

    h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_layers"]
    groups = m.get("num_query_groups") or heads
    d = m.get("kv_channels") or h // heads
    ffn = m["ffn_hidden_size"]
    shared = bool(m.get("share_embeddings_and_output_weights", False))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=d,
        max_position_embeddings=m["seq_length"], rms_norm_eps=m.get("layernorm_epsilon", 1e-5),
        rope_theta=float(m.get("rotary_base", 10000)), attention_bias=False, mlp_bias=False,
        hidden_act="silu", tie_word_embeddings=shared, architectures=["LlamaForCausalLM"],
        **ids, **rope_scaling(m),
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
    return {
        p + "input_layernorm.weight": t[L + "self_attention.linear_qkv.layer_norm_weight"][i],
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": t[L + "self_attention.linear_proj.weight"][i],
    }


def rope_scaling(m: dict) -> dict:
    """``rope_scaling`` of a LlamaConfig: megatron's Llama-3 scaling (``model.rope_scaling``,
    ``rope_scaling_factor``; megatron-core 0.19.2 ``RotaryEmbedding._apply_scaling`` fixes the
    other three parameters), or none."""
    if not m.get("rope_scaling", False):
        return {}
    factor = float(m.get("rope_scaling_factor", 8.0))
    return {"rope_scaling": {"rope_type": "llama3", "factor": factor,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
