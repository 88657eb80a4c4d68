"""The MoE family's Hugging Face weight names, both ways: one table per architecture
(:mod:`ckpt.hf.mapping`) from which the import plan, the export state dict and the size checks
are derived.

Attention, norms, embeddings and ``lm_head`` are Llama's
(:func:`recipes.families.gpt.hf_table.llama_attention`, ``llama_ends``); the MLP of every layer
(under ``model.layers.<i>.``) is megatron's MoE layer:

* ``decoder.layers.mlp.router.weight`` [L, E, H] <-> ``<moe>.gate.weight`` [E, H];
* ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, 2F, H] <-> per expert
  ``[gate; up]`` (megatron's gated fc1: gate rows, then up rows);
* ``decoder.layers.mlp.experts.experts.linear_fc2.weight`` [L, E, H, F] <-> per expert ``down``.

Saved names (the Hub's per-expert form that ``save_pretrained`` writes and an import reads):
Mixtral ``block_sparse_moe.gate``, ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up),
``w2`` (down); Qwen3-MoE ``mlp.gate``, ``mlp.experts.<e>.gate_proj`` / ``up_proj`` /
``down_proj``. Loaded names (transformers >= 5's model, which an export fills): ``mlp.gate``,
``mlp.experts.gate_up_proj`` [E, 2F, H] (transformers splits it with ``chunk(2)``: gate, up) and
``mlp.experts.down_proj`` [E, H, F], megatron's stacks as they are.
"""

from __future__ import annotations

from ckpt.hf.mapping import Direct, Experts, GatedFC1, per_layer_keys
from recipes.families.gpt.hf_table import F, H, L, llama_attention, llama_ends, pre_mlp_norm

# model_type: (the saved MLP module's name, saved expert tensor names gate, up, down)
NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
         "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def moe(kind: str, m: dict) -> list:
    """Every tensor of a ``kind`` (``"mixtral"`` / ``"qwen3_moe"``) model (names after
    ``model.``): Llama's ends and attention, then per layer the router and the experts."""
    mlp, (gate, up, down) = NAMES[kind]
    saved, held = f"layers.{{i}}.{mlp}.", "layers.{i}.mlp."
    h, f = ("hidden", 1), ("expert_ffn", 1)
    experts = saved + "experts.{e}."
    return llama_ends(m) + llama_attention(m) + [
        pre_mlp_norm(),
        # The router first: check_sizes counts the experts from its rows before their names.
        Direct(L + "mlp.router.weight", (saved + "gate.weight",), ((("experts", 1), h),),
               loaded=(held + "gate.weight",)),
        Experts(L + "mlp.experts.experts.linear_fc1.weight",
                (experts + gate + ".weight", experts + up + ".weight"), ((f, h), (f, h)),
                loaded=(held + "experts.gate_up_proj",)),
        Experts(L + "mlp.experts.experts.linear_fc2.weight", (experts + down + ".weight",),
                ((h, f),), loaded=(held + "experts.down_proj",)),
    ]


# --------------------------------------------------------------------------------------------
# DeepSeek-V3 (Kimi-K2, Moonlight) and GLM-4.5: dense first layers, a shared expert, a sigmoid
# router whose expert bias (``e_score_correction_bias``) is megatron's ``router.expert_bias``.
# With dense layers first megatron keys every tensor per layer (``decoder.layers.<i>.``:
# ``moe_layer_freq`` as a list makes its layers non-homogeneous); else the tables are stacked.
# --------------------------------------------------------------------------------------------
E_H = (("experts", 1), H)
SHARED = ("shared_ffn", 1)


def moe_layers(m: dict) -> tuple[list, list]:
    """(dense layers, MoE layers), 0-based, of ``m``'s ``moe_layer_freq`` (an int N: every
    N-th layer MoE; a list: 1 per MoE layer)."""
    freq = m.get("moe_layer_freq", 1)
    n = m["num_layers"]
    flags = list(freq) if isinstance(freq, (list, tuple)) else [i % int(freq) == 0
                                                                  for i in range(n)]
    return ([i for i in range(n) if not flags[i]], [i for i in range(n) if flags[i]])


def _sigmoid_moe(m: dict) -> list:
    """A DeepSeek-style MoE MLP (names after ``layers.{i}.mlp.``): router and expert bias,
    routed experts (the Hub's per-expert ``gate_proj``/``up_proj``/``down_proj``; transformers
    >= 5 holds them fused), the shared expert (``n_shared_experts`` of them as one MLP)."""
    p, f = "layers.{i}.mlp.", ("expert_ffn", 1)
    experts = p + "experts.{e}."
    out = [
        Direct(L + "mlp.router.weight", (p + "gate.weight",), (E_H,)),
        Direct(L + "mlp.router.expert_bias", (p + "gate.e_score_correction_bias",),
               ((("experts", 1),),)),
        Experts(L + "mlp.experts.experts.linear_fc1.weight",
                (experts + "gate_proj.weight", experts + "up_proj.weight"), ((f, H), (f, H)),
                loaded=(p + "experts.gate_up_proj",)),
        Experts(L + "mlp.experts.experts.linear_fc2.weight", (experts + "down_proj.weight",),
                ((H, f),), loaded=(p + "experts.down_proj",)),
    ]
    if m.get("moe_shared_expert_intermediate_size"):
        s = p + "shared_experts."
        out += [GatedFC1(L + "mlp.shared_experts.linear_fc1.weight",
                         (s + "gate_proj.weight", s + "up_proj.weight"), ((SHARED, H),) * 2),
                Direct(L + "mlp.shared_experts.linear_fc2.weight", (s + "down_proj.weight",),
                       ((H, SHARED),))]
    return out


def _dense_mlp() -> list:
    p = "layers.{i}.mlp."
    return [GatedFC1(L + "mlp.linear_fc1.weight", (p + "gate_proj.weight", p + "up_proj.weight"),
                     ((F, H), (F, H))),
            Direct(L + "mlp.linear_fc2.weight", (p + "down_proj.weight",), ((H, F),))]


def mla_attention(m: dict) -> list:
    """DeepSeek's multi-latent attention (names after ``layers.{i}.``) <-> megatron's
    ``MLASelfAttention`` (local spec): every projection as it is (megatron's up projections
    keep DeepSeek's per-head order ``[nope | rope]`` and ``[k nope | v]``, the kv down
    projection ``[kv latent | k rope]``), the norms ``q_layernorm``/``kv_layernorm``."""
    a = "layers.{i}.self_attn."
    out = [Direct(L + "input_layernorm.weight", ("layers.{i}.input_layernorm.weight",), ((H,),))]
    if m.get("q_lora_rank"):
        out += [Direct(L + "self_attention.linear_q_down_proj.weight", (a + "q_a_proj.weight",),
                       ((("q_lora", 1), H),)),
                Direct(L + "self_attention.q_layernorm.weight", (a + "q_a_layernorm.weight",),
                       ((("q_lora", 1),),)),
                Direct(L + "self_attention.linear_q_up_proj.weight", (a + "q_b_proj.weight",),
                       ((("heads", "q_head"), ("q_lora", 1)),))]
    else:
        out.append(Direct(L + "self_attention.linear_q_proj.weight", (a + "q_proj.weight",),
                          ((("heads", "q_head"), H),)))
    return out + [
        Direct(L + "self_attention.linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",),
               ((("kv_down", 1), H),)),
        Direct(L + "self_attention.kv_layernorm.weight", (a + "kv_a_layernorm.weight",),
               ((("kv_lora", 1),),)),
        Direct(L + "self_attention.linear_kv_up_proj.weight", (a + "kv_b_proj.weight",),
               ((("heads", "kv_head"), ("kv_lora", 1)),)),
        Direct(L + "self_attention.linear_proj.weight", (a + "o_proj.weight",),
               ((H, ("heads", "v_head")),)),
        Direct(L + "pre_mlp_layernorm.weight", ("layers.{i}.post_attention_layernorm.weight",),
               ((H,),)),
    ]


def _with_dense_first(m: dict, attention: list) -> list:
    """``attention`` and the MLPs of every layer: stacked when every layer is MoE, else one
    megatron key per layer (dense layers' MLP on the dense ones, the MoE MLP on the others)."""
    dense, sparse = moe_layers(m)
    if not dense:
        return attention + _sigmoid_moe(m)
    every = range(m["num_layers"])
    return (per_layer_keys(attention, every) + per_layer_keys(_dense_mlp(), dense)
            + per_layer_keys(_sigmoid_moe(m), sparse))


def deepseek_v3(m: dict) -> list:
    """Every tensor of a ``DeepseekV3ForCausalLM`` (names after ``model.``)."""
    return llama_ends(m) + _with_dense_first(m, mla_attention(m))


def glm4_moe(m: dict) -> list:
    """Every tensor of a ``Glm4MoeForCausalLM`` (names after ``model.``): Llama's attention
    (q/k/v biases with ``add_qkv_bias``, q/k norms with ``qk_layernorm``) and the DeepSeek MoE."""
    return llama_ends(m) + _with_dense_first(m, llama_attention(m) + [pre_mlp_norm()])
