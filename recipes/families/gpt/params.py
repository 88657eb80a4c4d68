"""The parameters megatron's ``GPTModel`` (local layer spec) holds for a dense config, without
building it (a multi-process test compares the table with built models at several layouts)."""

from __future__ import annotations

from typing import Callable, Optional

from recipes.shapes import ParamShape, getter, kv_channels, qkv_rows

# ``(model config, layer index, "decoder.layers.<i>", add) -> handled``: a family's MLP of one
# layer, or False to leave that layer's MLP dense.
MlpShapes = Callable[[object, int, str, Callable[[ParamShape], None]], bool]


def mlp_shapes(m, prefix: str, width: int, add: Callable[[ParamShape], None],
               expert: bool = False) -> None:
    """Add an ``MLP``'s parameters under ``prefix`` (``linear_fc1`` twice ``width`` rows with
    SwiGLU: gate and up; biases when ``add_bias_linear``); ``expert``: a routed expert's."""
    gated = 2 if m.swiglu else 1
    h, bias = m.hidden_size, getter(m)("add_bias_linear", True)
    add(ParamShape(f"{prefix}.linear_fc1.weight", (gated * width, h), 0, True, expert))
    if bias:
        add(ParamShape(f"{prefix}.linear_fc1.bias", (gated * width,), 0, False, expert))
    add(ParamShape(f"{prefix}.linear_fc2.weight", (h, width), 1, True, expert))
    if bias:
        add(ParamShape(f"{prefix}.linear_fc2.bias", (h,), None, False, expert))


def parameter_shapes(m, padded_vocab: int, mlp: Optional[MlpShapes] = None) -> list[ParamShape]:
    """Every parameter of megatron's ``GPTModel`` with the local layer spec, in module order.

    Args:
        m: the ``model`` config (``ModelConfig`` fields).
        padded_vocab: rows of the embedding and output layer (the padded vocabulary).
        mlp: another family's MLP of some layers (the MoE family's experts); None: all dense.

    Returns:
        The ``ParamShape`` list. Norm weights (and LayerNorm biases), linear biases when
        ``add_bias_linear``, the learned position embedding and the output layer (absent when
        embeddings and output weights are shared) follow megatron's module tree.
    """
    get = getter(m)
    h = m.hidden_size
    bias = get("add_bias_linear", True)
    norm_bias = get("normalization", "LayerNorm") == "LayerNorm"
    attn = m.num_attention_heads * kv_channels(m)
    out = [ParamShape("embedding.word_embeddings.weight", (padded_vocab, h), 0, True)]
    if get("position_embedding_type", "learned_absolute") == "learned_absolute":
        out.append(ParamShape("embedding.position_embeddings.weight", (m.seq_length, h)))

    def norm(prefix, width=h):
        out.append(ParamShape(f"{prefix}.weight", (width,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}.bias", (width,)))

    for i in range(m.num_layers):
        layer = f"decoder.layers.{i}"
        norm(f"{layer}.input_layernorm")
        out.append(ParamShape(f"{layer}.self_attention.linear_qkv.weight", (qkv_rows(m), h), 0, True))
        if bias or get("add_qkv_bias", False):
            out.append(ParamShape(f"{layer}.self_attention.linear_qkv.bias", (qkv_rows(m),), 0))
        if get("qk_layernorm", False):
            norm(f"{layer}.self_attention.q_layernorm", kv_channels(m))
            norm(f"{layer}.self_attention.k_layernorm", kv_channels(m))
        out.append(ParamShape(f"{layer}.self_attention.linear_proj.weight", (h, attn), 1, True))
        if bias:
            out.append(ParamShape(f"{layer}.self_attention.linear_proj.bias", (h,)))
        norm(f"{layer}.pre_mlp_layernorm")
        if not (mlp and mlp(m, i, layer, out.append)):
            mlp_shapes(m, f"{layer}.mlp", m.ffn_hidden_size, out.append)
    norm("decoder.final_layernorm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out
