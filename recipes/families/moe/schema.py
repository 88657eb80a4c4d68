"""The MoE family's own ``model`` fields (megatron ``TransformerConfig`` names; docs/moe.md),
merged into the run's ``model`` schema (``recipes.config.schema.ModelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class MoEFields:
    """Routed experts: ``num_moe_experts`` marks an MoE model (a dense MLP without it)."""

    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    # Softmax over all experts before the top-k (no renormalisation); megatron requires it at
    # top-1. false: top-k of the logits, then softmax over those k (Mixtral's routing).
    moe_router_pre_softmax: bool = False
    # softmax | sigmoid (DeepSeek-V3: each expert's score sigmoid(logit), the top-k of them
    # renormalised to sum 1 when top-k > 1).
    moe_router_score_function: str = "softmax"
    # Multiplies the routing weights after the top-k (DeepSeek-V3's routed_scaling_factor 2.5).
    moe_router_topk_scaling_factor: Optional[float] = None
    # Aux-loss-free balancing (sigmoid only): a per-expert bias added to the scores for the
    # top-k choice only, moved by moe_router_bias_update_rate after each step towards the
    # experts that got fewer tokens (megatron's TopKRouter.expert_bias, checkpointed).
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Group-limited routing: experts in moe_router_num_groups equal groups, each token choosing
    # its top-k within its best moe_router_group_topk groups (DeepSeek-V3: 8 and 4). null: off.
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    # Width of each routed expert's MLP; null: ffn_hidden_size.
    moe_ffn_hidden_size: Optional[int] = None
    # Width of the shared expert every token goes through (DeepSeek, Qwen2-MoE); null: none.
    moe_shared_expert_intermediate_size: Optional[int] = None
    # A sigmoid gate on the shared expert's output, sigmoid(x @ gate_weight.T) (Qwen2-MoE,
    # Qwen3-Next; megatron's SharedExpertMLP.gate_weight [1, hidden_size]); needs a shared expert.
    moe_shared_expert_gate: bool = False
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"  # allgather | alltoall
    # megatron's moe_layer_freq: an int N (layer i is MoE when i % N == 0; 1: every layer) or a
    # list of 0/1 per layer (1: MoE, 0: dense; DeepSeek-V3's dense first layers: [0, 0, 0, 1, ...]).
    # Any: OmegaConf's structured configs have no int-or-list type.
    moe_layer_freq: Any = 1


# The family's fields set in every one of its configs and in no other family's.
REQUIRES = ("num_moe_experts",)
# Its fields that size a parameter (beyond the shared ones, recipes.config.schema.SHAPE_FIELDS);
# moe_router_enable_expert_bias adds a stored tensor per MoE layer (the router's expert_bias).
SHAPE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                "moe_layer_freq", "moe_router_enable_expert_bias", "moe_shared_expert_gate")
