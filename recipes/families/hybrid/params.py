"""The parameters megatron's ``HybridModel`` (the local hybrid stack spec) holds, without
building it (a multi-process test compares the table with built models at several layouts)."""

from __future__ import annotations

from recipes.families.gpt.params import attention_shapes, embedding_shapes, mlp_shapes
from recipes.families.hybrid.model import ATTENTION, MAMBA, MLP, layer_symbols
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


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of megatron's ``HybridModel`` with the local stack spec, layer by layer
    as ``hybrid_layer_pattern`` orders them: a Mamba layer's norm and mixer (``in_proj``
    column-parallel and GTP-sharded; ``conv1d``, ``A_log``, ``D``, ``dt_bias`` and the gated
    norm TP-split, not GTP weights; ``out_proj`` row-parallel and GTP-sharded), an attention
    layer's norm and attention, an MLP layer's norm and MLP, as the GPT family's (biases when
    ``add_bias_linear``); the embedding as the GPT family's (a position embedding when
    ``position_embedding_type=learned_absolute``).

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

    symbols = layer_symbols(m.hybrid_layer_pattern)
    if MAMBA in symbols:  # without Mamba layers their sizes may be unset
        d = mamba_dims(m)
        conv = d["d_inner"] + 2 * d["groups"] * d["state"]
    for i, symbol in enumerate(symbols):
        layer = f"decoder.layers.{i}"
        if symbol == MAMBA:
            norm(f"{layer}.norm")
            mixer = f"{layer}.mixer"
            out += [ParamShape(f"{mixer}.conv1d_weight", (conv, 1, 4), 0),
                    ParamShape(f"{mixer}.conv1d_bias", (conv,), 0),
                    ParamShape(f"{mixer}.dt_bias", (d["nheads"],), 0),
                    ParamShape(f"{mixer}.A_log", (d["nheads"],), 0),
                    ParamShape(f"{mixer}.D", (d["nheads"],), 0),
                    ParamShape(f"{mixer}.in_proj.weight", (d["in_proj"], h), 0, True),
                    ParamShape(f"{mixer}.norm.weight", (d["d_inner"],), 0),
                    ParamShape(f"{mixer}.out_proj.weight", (h, d["d_inner"]), 1, True)]
        elif symbol == ATTENTION:
            attention_shapes(m, layer, out.append, norm)
        elif symbol == MLP:
            norm(f"{layer}.pre_mlp_layernorm")
            mlp_shapes(m, f"{layer}.mlp", m.ffn_hidden_size, out.append)
    norm("decoder.final_norm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out
