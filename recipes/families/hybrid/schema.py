"""The hybrid family's own ``model`` fields (megatron's ``HybridModel`` names; docs/hybrid.md),
merged into the run's ``model`` schema (``recipes.config.schema.ModelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class HybridFields:
    """Mamba layers mixed with attention and MLP layers."""

    # One symbol a layer, "M" Mamba, "*" attention, "-" MLP ("|" between pipeline stages).
    hybrid_layer_pattern: Optional[str] = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    # null: hidden_size * 2 / mamba_head_dim (megatron's default, expand 2).
    mamba_num_heads: Optional[int] = None
    # Steps of the SSD scan's chunks (MambaMixer's chunk_size).
    mamba_chunk_size: int = 128


# The family's fields set in every one of its configs and in no other family's.
REQUIRES = ("hybrid_layer_pattern",)
# Its fields that size a parameter (beyond the shared ones, recipes.config.schema.SHAPE_FIELDS).
SHAPE_FIELDS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                "mamba_num_heads")
