"""The parameters megatron's ``HybridModel`` (the local hybrid stack spec) holds, without
building it (a multi-process test compares the table with built models at several layouts)."""

from __future__ import annotations

from recipes.families.gpt.params import attention_shapes, embedding_shapes, mlp_shapes
from recipes.families.hybrid.model import (
    ATTENTION,
    GDN,
    MAMBA,
    MLP,
    MOE,
    layer_symbols,
    mtp_parts,
)
from recipes.families.moe.params import moe_shapes
from recipes.model.shapes import ParamShape, getter


def mamba_dims(m) -> dict:
    """megatron's ``MambaMixer`` sizes (``ssm/mamba_mixer.py``, expand 2): ``d_inner``,
    ``nheads`` of ``head_dim``, ``groups`` and ``state`` (whole model, before TP), and
    ``in_proj`` rows ``2 d_inner + 2 groups state + nheads`` (``z | x | B | C | dt``).

    Args:
        m: the ``model`` config, or its recorded dict (read through ``get`` only).
    """
    get = getter(m)
    head = int(get("mamba_head_dim"))
    heads = int(get("mamba_num_heads") or (2 * get("hidden_size")) // head)
    inner, groups, state = heads * head, int(get("mamba_num_groups")), int(get("mamba_state_dim"))
    return {"d_inner": inner, "nheads": heads, "head_dim": head, "groups": groups,
            "state": state, "in_proj": 2 * inner + 2 * groups * state + heads}


def gdn_dims(m) -> dict:
    """megatron's ``GatedDeltaNet`` sizes (``ssm/gated_delta_net/common.py``, whole model,
    before TP): ``qk`` = key heads x key head dim, ``v`` = value heads x value head dim,
    ``heads`` (value heads), ``head_v`` (value head dim, ``out_norm``'s width), ``kernel``
    (``conv1d``'s), ``in_proj`` rows ``2 qk + 2 v + 2 heads`` (``q | k | v | z | beta | alpha``)
    and ``conv`` channels ``2 qk + v`` (``q | k | v``).

    Args:
        m: the ``model`` config, or its recorded dict (read through ``get`` only).
    """
    get = getter(m)
    qk = int(get("linear_num_key_heads")) * int(get("linear_key_head_dim"))
    heads, head_v = int(get("linear_num_value_heads")), int(get("linear_value_head_dim"))
    v = heads * head_v
    return {"qk": qk, "v": v, "heads": heads, "head_v": head_v,
            "kernel": int(get("linear_conv_kernel_dim")), "in_proj": 2 * qk + 2 * v + 2 * heads,
            "conv": 2 * qk + v}


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of megatron's ``HybridModel`` with the local stack spec, layer by layer
    as ``hybrid_layer_pattern`` orders them: a Mamba layer's norm and mixer (``in_proj``
    column-parallel and GTP-sharded; ``conv1d``, ``A_log``, ``D``, ``dt_bias`` and the gated
    norm TP-split, not GTP weights; ``out_proj`` row-parallel and GTP-sharded), a GatedDeltaNet
    layer's input norm and ``self_attention`` (``dt_bias``, ``A_log`` and ``conv1d`` TP-split,
    ``in_proj`` column-parallel and ``out_proj`` row-parallel, both GTP-sharded, ``out_norm``
    over one value head, whole on every rank; no biases: megatron's default), an attention
    layer's norm and attention, an MLP layer's norm and MLP, as the GPT family's (biases when
    ``add_bias_linear``), an MoE layer's ``pre_mlp_layernorm`` and ``MoELayer`` as the MoE
    family's (router, ``num_moe_experts`` routed experts with ``expert=True``, the optional
    shared expert); the embedding as the GPT family's (a position embedding when
    ``position_embedding_type=learned_absolute``). Each MTP depth of the pattern (a part after
    ``/``) is megatron's ``mtp.layers.<i>``: ``enorm``, ``hnorm``, ``eh_proj`` (hidden x 2
    hidden, column-parallel, GTP-sharded), the part's layers as above under
    ``mtp_model_layer.layers.<j>``, and ``final_layernorm``; a pipeline stage holding the MTP
    layers but not the first layer also holds a copy of ``embedding.word_embeddings.weight``
    (not listed twice).

    Args:
        m: the ``model`` config; padded_vocab: rows of the embedding and output layer.
    """
    get = getter(m)
    h = m.hidden_size
    norm_bias = get("normalization", "LayerNorm") == "LayerNorm"
    out = embedding_shapes(m, padded_vocab)

    def norm(prefix, width=h):
        out.append(ParamShape(f"{prefix}.weight", (width,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}.bias", (width,)))

    pattern = str(m.hybrid_layer_pattern)
    for i, symbol in enumerate(layer_symbols(pattern)):
        _sublayer(m, f"decoder.layers.{i}", symbol, out.append, norm)
    norm("decoder.final_norm")
    for i, part in enumerate(mtp_parts(pattern)):
        # megatron's MultiTokenPredictionLayer (hybrid path): the norms of the embedding and of
        # the hidden state, eh_proj ([embedding; hidden] -> hidden, column-parallel), the
        # depth's layers as a HybridStack without a final norm, then its own final norm.
        layer = f"mtp.layers.{i}"
        norm(f"{layer}.enorm")
        norm(f"{layer}.hnorm")
        out.append(ParamShape(f"{layer}.eh_proj.weight", (h, 2 * h), 0, True))
        for j, symbol in enumerate(part):
            _sublayer(m, f"{layer}.mtp_model_layer.layers.{j}", symbol, out.append, norm)
        norm(f"{layer}.final_layernorm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out


def _sublayer(m, layer: str, symbol: str, add, norm) -> None:
    """Add the parameters of one layer of a ``HybridStack`` (``symbol``) under ``layer``."""
    h = m.hidden_size
    if symbol == MAMBA:
        d = mamba_dims(m)
        conv = d["d_inner"] + 2 * d["groups"] * d["state"]
        norm(f"{layer}.norm")
        mixer = f"{layer}.mixer"
        for entry in (ParamShape(f"{mixer}.conv1d_weight", (conv, 1, 4), 0),
                      ParamShape(f"{mixer}.conv1d_bias", (conv,), 0),
                      ParamShape(f"{mixer}.dt_bias", (d["nheads"],), 0),
                      ParamShape(f"{mixer}.A_log", (d["nheads"],), 0),
                      ParamShape(f"{mixer}.D", (d["nheads"],), 0),
                      ParamShape(f"{mixer}.in_proj.weight", (d["in_proj"], h), 0, True),
                      ParamShape(f"{mixer}.norm.weight", (d["d_inner"],), 0),
                      ParamShape(f"{mixer}.out_proj.weight", (h, d["d_inner"]), 1, True)):
            add(entry)
    elif symbol == GDN:
        g = gdn_dims(m)
        norm(f"{layer}.input_layernorm")
        net = f"{layer}.self_attention"
        add(ParamShape(f"{net}.dt_bias", (g["heads"],), 0))
        add(ParamShape(f"{net}.A_log", (g["heads"],), 0))
        add(ParamShape(f"{net}.in_proj.weight", (g["in_proj"], h), 0, True))
        add(ParamShape(f"{net}.conv1d.weight", (g["conv"], 1, g["kernel"]), 0))
        norm(f"{net}.out_norm", g["head_v"])
        add(ParamShape(f"{net}.out_proj.weight", (h, g["v"]), 1, True))
    elif symbol == ATTENTION:
        attention_shapes(m, layer, add, norm)
    elif symbol == MLP:
        norm(f"{layer}.pre_mlp_layernorm")
        mlp_shapes(m, f"{layer}.mlp", m.ffn_hidden_size, add)
    elif symbol == MOE:
        norm(f"{layer}.pre_mlp_layernorm")
        moe_shapes(m, layer, add)
