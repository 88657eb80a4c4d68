"""The MoE family's parameter table: the GPT family's, with megatron's ``MoELayer`` as the MLP
of every ``moe_layer_freq``-th layer."""

from __future__ import annotations

from recipes.families.gpt.params import mlp_shapes, parameter_shapes as gpt_parameter_shapes
from recipes.model.shapes import ParamShape, getter


def is_moe_layer(m, layer: int) -> bool:
    """Whether 0-based ``layer`` has an MoE MLP: ``num_moe_experts`` set and ``layer`` a multiple
    of ``moe_layer_freq`` (megatron's int ``moe_layer_freq``: layer i is MoE when
    ``i % freq == 0``)."""
    get = getter(m)
    if not get("num_moe_experts"):
        return False
    return layer % int(get("moe_layer_freq", 1) or 1) == 0


def moe_mlp_shapes(m, i: int, layer: str, add) -> bool:
    """megatron's ``MoELayer`` of 0-based layer ``i`` under ``layer``: ``TopKRouter`` (weight
    ``[experts, hidden]``, replicated), ``SequentialMLP`` (``local_experts.<e>``, an ``MLP``
    each), then the optional ``SharedExpertMLP``. False (a dense MLP) off the MoE layers."""
    if not is_moe_layer(m, i):
        return False
    get = getter(m)
    experts = int(get("num_moe_experts"))
    add(ParamShape(f"{layer}.mlp.router.weight", (experts, m.hidden_size)))
    width = get("moe_ffn_hidden_size") or m.ffn_hidden_size
    for e in range(experts):
        mlp_shapes(m, f"{layer}.mlp.experts.local_experts.{e}", width, add, expert=True)
    shared = get("moe_shared_expert_intermediate_size")
    if shared:
        mlp_shapes(m, f"{layer}.mlp.shared_experts", shared, add)
    return True


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of an MoE ``GPTModel`` (local spec), module by module (see
    ``recipes.families.gpt.params.parameter_shapes``); routed experts' entries have
    ``expert=True``."""
    return gpt_parameter_shapes(m, padded_vocab, moe_mlp_shapes)
