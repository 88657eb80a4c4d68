"""The GPT family's own ``model`` fields: multi-latent attention (megatron's
``MLATransformerConfig`` names and defaults; docs/mla.md). Everything else of a GPT model is the
shared decoder the other families build on (``recipes.config.schema.ModelConfig``'s shared
fields, whose parameter-sizing ones are ``recipes.config.schema.SHAPE_FIELDS``). ``REQUIRES``
is empty, so the MoE family, which builds the GPT family's model, takes these fields too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class GPTFields:
    """Multi-latent attention (DeepSeek-V2/V3): megatron's ``MLASelfAttention`` in place of
    ``SelfAttention`` when ``multi_latent_attention``; the defaults are megatron's
    ``MLATransformerConfig``'s. ``qk_layernorm`` then means MLA's norms of the compressed query
    and key/value (``q_layernorm``, ``kv_layernorm``); RoPE (``rotary_base``,
    ``rotary_percent``) applies to the decoupled ``qk_pos_emb_head_dim`` part only."""

    multi_latent_attention: bool = False
    # Rank of the compressed query (linear_q_down_proj's rows); null: no compression, one
    # linear_q_proj from the hidden state (DeepSeek-V2-Lite).
    q_lora_rank: Optional[int] = 512
    # Rank of the compressed key/value (linear_kv_down_proj's rows before the RoPE part).
    kv_lora_rank: int = 512
    # Per-head widths: query/key without position (qk_head_dim), their RoPE part
    # (qk_pos_emb_head_dim; one key part shared by every head), value (v_head_dim).
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "yarn"  # rope | yarn (megatron's YarnRotaryEmbedding)
    # YaRN (rope_type=yarn); rotary_scaling_factor and mscale_all_dim also set the softmax
    # scale (megatron's _yarn_get_mscale) whatever the rope_type.
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


# The family's fields set in every one of its configs and in no other family's: none.
REQUIRES: tuple[str, ...] = ()
# Its fields that size a parameter beyond the shared ones.
SHAPE_FIELDS: tuple[str, ...] = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                                 "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
