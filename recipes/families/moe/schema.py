"""The MoE family's own ``model`` fields (megatron ``TransformerConfig`` names; docs/moe.md),
merged into the run's ``model`` schema (``recipes.config.schema.ModelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MoEFields:
    """Routed experts: ``num_moe_experts`` marks an MoE model (a dense MLP without it)."""

    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    # Softmax over all experts before the top-k (no renormalisation); megatron requires it at
    # top-1. false: top-k of the logits, then softmax over those k (Mixtral's routing).
    moe_router_pre_softmax: bool = False
    # Width of each routed expert's MLP; null: ffn_hidden_size.
    moe_ffn_hidden_size: Optional[int] = None
    # Width of the shared expert every token goes through (DeepSeek, Qwen2-MoE); null: none.
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"  # allgather | alltoall
    # 1: every layer is MoE; N: every N-th layer (megatron's int form of moe_layer_freq).
    moe_layer_freq: int = 1


# The family's fields set in every one of its configs and in no other family's.
REQUIRES = ("num_moe_experts",)
# Its fields that size a parameter (beyond the shared ones, recipes.config.schema.SHAPE_FIELDS).
SHAPE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                "moe_layer_freq")
