"""The MoE family's parameter table: the GPT family's, with megatron's ``MoELayer`` as the MLP
of the layers ``moe_layer_freq`` makes MoE (every N-th, or a 0/1 list per layer)."""

from __future__ import annotations


from recipes.families.gpt.params import mlp_shapes, parameter_shapes as gpt_parameter_shapes
from recipes.model.shapes import ParamShape, getter


def layer_freq(m):
    """``model.moe_layer_freq`` as megatron takes it: an int, or a list of ints (0 dense, 1 MoE,
    one per decoder layer) from a list (an OmegaConf ``ListConfig`` included)."""
    value = getter(m)("moe_layer_freq", 1)
    if value is None:
        return 1
    if isinstance(value, (int, str, float)):
        return int(value)
    return [int(v) for v in value]


def is_moe_layer(m, layer: int) -> bool:
    """Whether 0-based decoder ``layer`` has an MoE MLP: ``num_moe_experts`` set and, as
    megatron's ``get_gpt_decoder_block_spec`` reads ``moe_layer_freq``, ``layer % freq == 0`` for
    an int, ``freq[layer] == 1`` for a list of 0/1 per layer."""
    if not getter(m)("num_moe_experts"):
        return False
    freq = layer_freq(m)
    if isinstance(freq, list):
        return layer < len(freq) and freq[layer] == 1
    return layer % freq == 0


def moe_mlp_shapes(m, i: int, layer: str, add) -> bool:
    """:func:`moe_shapes` for 0-based layer ``i`` under ``layer`` when ``moe_layer_freq`` makes
    it an MoE layer; False (a dense MLP) off the MoE layers."""
    if not is_moe_layer(m, i):
        return False
    moe_shapes(m, layer, add)
    return True


def moe_shapes(m, layer: str, add) -> None:
    """megatron's ``MoELayer`` under ``layer`` (``<layer>.mlp``), each ``ParamShape`` passed to
    ``add``: ``TopKRouter`` (weight ``[experts, hidden]``, replicated), ``SequentialMLP``
    (``local_experts.<e>``, an ``MLP`` each, ``expert=True``), then the optional
    ``SharedExpertMLP`` (with ``moe_shared_expert_gate`` its ``gate_weight`` ``[1, hidden]``,
    replicated). The router's ``expert_bias`` is a buffer, not listed."""
    get = getter(m)
    experts = int(get("num_moe_experts"))
    add(ParamShape(f"{layer}.mlp.router.weight", (experts, m.hidden_size)))
    width = get("moe_ffn_hidden_size") or m.ffn_hidden_size
    # One expert's entries, renamed per expert: a config read per entry is slow (DeepSeek-V3's
    # 58 layers of 256 experts).
    expert: list[ParamShape] = []
    mlp_shapes(m, "", width, expert.append, expert=True)
    for e in range(experts):
        prefix = f"{layer}.mlp.experts.local_experts.{e}"
        for entry in expert:
            add(ParamShape(prefix + entry.name, entry.shape, entry.tp_axis, entry.gtp, True))
    shared = get("moe_shared_expert_intermediate_size")
    if shared:
        mlp_shapes(m, f"{layer}.mlp.shared_experts", shared, add)
        if get("moe_shared_expert_gate"):
            add(ParamShape(f"{layer}.mlp.shared_experts.gate_weight", (1, m.hidden_size)))


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of an MoE ``GPTModel`` (local spec), module by module (see
    ``recipes.families.gpt.params.parameter_shapes``); routed experts' entries have
    ``expert=True``."""
    return gpt_parameter_shapes(m, padded_vocab, moe_mlp_shapes)
