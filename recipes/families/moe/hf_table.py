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

from ckpt.hf.mapping import Direct, Experts
from recipes.families.gpt.hf_table import L, llama_attention, llama_ends, pre_mlp_norm

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
