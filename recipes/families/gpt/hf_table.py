"""The GPT family's Hugging Face weight names, both ways: one table per architecture
(:mod:`ckpt.hf.mapping`) from which the import plan, the export state dict and the size checks
are derived.

* ``GPT2LMHeadModel``: under ``transformer.``; GPT-2's ``Conv1D`` weights are ``[in, out]``
  (transposed), ``c_attn``'s ``[q | k | v]`` columns are megatron's fused per-head QKV rows.
* ``LlamaForCausalLM`` (and Mistral, Qwen2, Qwen3): under ``model.``; q/k/v (and Qwen2's biases)
  fused per query group, ``[gate_proj; up_proj]`` the gated fc1, Qwen3's q/k norms megatron's
  ``q_layernorm``/``k_layernorm``. Its attention and the tensors outside the layers are the MoE
  family's too (:mod:`recipes.families.moe.hf_table`).

``lm_head`` (outside the base model's prefix) is listed unless the output layer is the
embedding (``share_embeddings_and_output_weights``).
"""

from __future__ import annotations

from ckpt.hf.mapping import QKV, ColumnQKV, Direct, GatedFC1

L = "decoder.layers."  # megatron's per-layer keys (stacked on dim 0)
H, F, V = ("hidden", 1), ("ffn", 1), ("vocab", 1)
Q, G = ("heads", "head_dim"), ("groups", "head_dim")  # q rows; k/v rows (query groups)


def output_layer(m: dict) -> list:
    """The output layer ``lm_head`` ``[vocab, hidden]``, none when it is the embedding."""
    if m.get("share_embeddings_and_output_weights", False):
        return []
    return [Direct("output_layer.weight", ("lm_head.weight",), ((V, H),), vocab=True,
                   prefixed=False)]


def gpt2(m: dict) -> list:
    """Every tensor of a GPT-2 model (names after ``transformer.``)."""
    p = "h.{i}."
    return [
        Direct("embedding.word_embeddings.weight", ("wte.weight",), ((V, H),), vocab=True),
        Direct("embedding.position_embeddings.weight", ("wpe.weight",), ((("positions", 1), H),)),
        Direct("decoder.final_layernorm.weight", ("ln_f.weight",), ((H,),)),
        Direct("decoder.final_layernorm.bias", ("ln_f.bias",), ((H,),)),
        Direct(L + "self_attention.linear_qkv.layer_norm_weight", (p + "ln_1.weight",), ((H,),)),
        Direct(L + "self_attention.linear_qkv.layer_norm_bias", (p + "ln_1.bias",), ((H,),)),
        ColumnQKV(L + "self_attention.linear_qkv.weight", (p + "attn.c_attn.weight",),
                  ((H, ("hidden", 3)),)),
        ColumnQKV(L + "self_attention.linear_qkv.bias", (p + "attn.c_attn.bias",),
                  ((("hidden", 3),),)),
        Direct(L + "self_attention.linear_proj.weight", (p + "attn.c_proj.weight",), ((H, H),),
               transpose=True),
        Direct(L + "self_attention.linear_proj.bias", (p + "attn.c_proj.bias",), ((H,),)),
        Direct(L + "mlp.linear_fc1.layer_norm_weight", (p + "ln_2.weight",), ((H,),)),
        Direct(L + "mlp.linear_fc1.layer_norm_bias", (p + "ln_2.bias",), ((H,),)),
        Direct(L + "mlp.linear_fc1.weight", (p + "mlp.c_fc.weight",), ((H, F),), transpose=True),
        Direct(L + "mlp.linear_fc1.bias", (p + "mlp.c_fc.bias",), ((F,),)),
        Direct(L + "mlp.linear_fc2.weight", (p + "mlp.c_proj.weight",), ((F, H),),
               transpose=True),
        Direct(L + "mlp.linear_fc2.bias", (p + "mlp.c_proj.bias",), ((H,),)),
    ] + output_layer(m)


def llama_ends(m: dict) -> list:
    """The Llama-family tensors outside the layers: ``embed_tokens``, ``norm``, ``lm_head``."""
    return [
        Direct("embedding.word_embeddings.weight", ("embed_tokens.weight",), ((V, H),),
               vocab=True),
        Direct("decoder.final_layernorm.weight", ("norm.weight",), ((H,),)),
    ] + output_layer(m)


def llama_attention(m: dict) -> list:
    """A Llama-family layer's input norm and attention (also Mixtral's and Qwen3-MoE's):
    q/k/v fused per query group, Qwen2's q/k/v biases (``add_qkv_bias``), Qwen3's q/k norms
    (``qk_layernorm``), ``o_proj``."""
    a = "layers.{i}.self_attn."
    qkv = tuple(a + f"{x}_proj." for x in "qkv")
    out = [
        Direct(L + "self_attention.linear_qkv.layer_norm_weight",
               ("layers.{i}.input_layernorm.weight",), ((H,),)),
        QKV(L + "self_attention.linear_qkv.weight", tuple(n + "weight" for n in qkv),
            ((Q, H), (G, H), (G, H))),
    ]
    if m.get("add_qkv_bias"):  # Qwen2
        out.append(QKV(L + "self_attention.linear_qkv.bias", tuple(n + "bias" for n in qkv),
                       ((Q,), (G,), (G,))))
    if m.get("qk_layernorm"):  # Qwen3 (and Qwen3-MoE)
        out += [Direct(L + f"self_attention.{x}_layernorm.weight", (a + f"{x}_norm.weight",),
                       ((("head_dim", 1),),)) for x in "qk"]
    out.append(Direct(L + "self_attention.linear_proj.weight", (a + "o_proj.weight",),
                      ((H, Q),)))
    return out


def pre_mlp_norm() -> Direct:
    """A Llama-family layer's norm before its MLP (``post_attention_layernorm``)."""
    return Direct(L + "mlp.linear_fc1.layer_norm_weight",
                  ("layers.{i}.post_attention_layernorm.weight",), ((H,),))


def llama(m: dict) -> list:
    """Every tensor of a Llama / Mistral / Qwen2 / Qwen3 model (names after ``model.``)."""
    p = "layers.{i}.mlp."
    return llama_ends(m) + llama_attention(m) + [
        pre_mlp_norm(),
        GatedFC1(L + "mlp.linear_fc1.weight", (p + "gate_proj.weight", p + "up_proj.weight"),
                 ((F, H), (F, H))),
        Direct(L + "mlp.linear_fc2.weight", (p + "down_proj.weight",), ((H, F),)),
    ]
