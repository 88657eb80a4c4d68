"""The hybrid family's own ``model`` fields (megatron's ``HybridModel`` names; docs/hybrid.md),
merged into the run's ``model`` schema (``recipes.config.schema.ModelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class HybridFields:
    """Mamba and GatedDeltaNet layers mixed with attention and MLP layers."""

    # One symbol a layer, "M" Mamba, "G" GatedDeltaNet, "*" attention, "-" MLP, "E" MoE ("|"
    # between pipeline stages); "/" then one multi-token prediction depth's layers, once a depth
    # (megatron's unified pattern, model.mtp_num_layers = the depths).
    hybrid_layer_pattern: Optional[str] = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    # null: hidden_size * 2 / mamba_head_dim (megatron's default, expand 2).
    mamba_num_heads: Optional[int] = None
    # Steps of the SSD scan's chunks (MambaMixer's chunk_size).
    mamba_chunk_size: int = 128
    # GatedDeltaNet ("G") layers: megatron's TransformerConfig fields and defaults (Qwen3-Next's
    # sizes). Keys and queries: linear_num_key_heads heads of linear_key_head_dim; values and
    # the output gate: linear_num_value_heads of linear_value_head_dim; the causal conv1d over
    # q | k | v: linear_conv_kernel_dim steps.
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Zero-centred norms (megatron's TransformerConfig field; Qwen3-Next's): every RMSNorm but
    # GatedDeltaNet's out_norm computes norm(x) * (1 + weight), weight starting at 0
    # (mcore_compat.zero_centered_norm for megatron's local norm).
    layernorm_zero_centered_gamma: bool = False


# The family's fields set in every one of its configs and in no other family's.
REQUIRES = ("hybrid_layer_pattern",)
# Its fields that size a parameter (beyond the shared ones, recipes.config.schema.SHAPE_FIELDS).
SHAPE_FIELDS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                "mamba_num_heads", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
