"""The parameters megatron's ``GPTModel`` (local layer spec) holds for a dense config, without
building it (a multi-process test compares the table with built models at several layouts)."""

from __future__ import annotations

from typing import Callable, Optional

from recipes.model.shapes import ParamShape, getter, kv_channels, qkv_rows

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
    """Every parameter of megatron's ``GPTModel`` with the local layer spec, module by module
    (within attention, ``linear_qkv`` before ``linear_proj``: the order of the computation).

    Args:
        m: the ``model`` config (``ModelConfig`` fields).
        padded_vocab: rows of the embedding and output layer (the padded vocabulary).
        mlp: another family's MLP of some layers (the MoE family's experts); None: all dense.

    Returns:
        The ``ParamShape`` list. Norm weights (and LayerNorm biases), linear biases when
        ``add_bias_linear``, the learned position embedding, the ``mtp_num_layers`` MTP layers
        and the output layer (absent when embeddings and output weights are shared) follow
        megatron's module tree. A pipeline stage holding the MTP layers but not the first
        layer also holds a copy of ``embedding.word_embeddings.weight`` (not listed twice).
    """
    get = getter(m)
    h = m.hidden_size
    norm_bias = get("normalization", "LayerNorm") == "LayerNorm"
    out = embedding_shapes(m, padded_vocab)

    def norm(prefix, width=h):
        out.append(ParamShape(f"{prefix}.weight", (width,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}.bias", (width,)))

    for i in range(m.num_layers):
        _layer(m, f"decoder.layers.{i}", i, out.append, norm, mlp)
    norm("decoder.final_layernorm")
    for i in range(int(get("mtp_num_layers") or 0)):
        # megatron's MultiTokenPredictionLayer: norms of the embedding and of the hidden state,
        # eh_proj ([embedding; hidden] -> hidden, column-parallel), a layer built from the
        # decoder's last layer spec, and a final norm; the output layer is the model's.
        layer = f"mtp.layers.{i}"
        norm(f"{layer}.enorm")
        norm(f"{layer}.hnorm")
        out.append(ParamShape(f"{layer}.eh_proj.weight", (h, 2 * h), 0, True))
        _layer(m, f"{layer}.mtp_model_layer", m.num_layers - 1, out.append, norm, mlp)
        norm(f"{layer}.final_layernorm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out


def embedding_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """megatron's ``LanguageModelEmbedding``: the word embedding (``padded_vocab`` x hidden,
    vocab-parallel and GTP-sharded) and, with ``position_embedding_type=learned_absolute``,
    the position embedding (``seq_length`` x hidden, replicated)."""
    h = m.hidden_size
    out = [ParamShape("embedding.word_embeddings.weight", (padded_vocab, h), 0, True)]
    if getter(m)("position_embedding_type", "learned_absolute") == "learned_absolute":
        out.append(ParamShape("embedding.position_embeddings.weight", (m.seq_length, h)))
    return out


def _layer(m, layer: str, index: int, add: Callable[[ParamShape], None], norm, mlp) -> None:
    """Add one ``TransformerLayer``'s parameters under ``layer``; ``index``: the decoder layer
    whose MLP kind it has (``mlp``)."""
    attention_shapes(m, layer, add, norm)
    norm(f"{layer}.pre_mlp_layernorm")
    if not (mlp and mlp(m, index, layer, add)):
        mlp_shapes(m, f"{layer}.mlp", m.ffn_hidden_size, add)


def attention_shapes(m, layer: str, add: Callable[[ParamShape], None], norm) -> None:
    """Add a layer's ``input_layernorm`` and ``self_attention`` under ``layer`` (``linear_qkv``
    of :func:`recipes.model.shapes.qkv_rows` rows, the gate's included under
    ``attention_output_gate``, with its bias when ``add_bias_linear`` or ``add_qkv_bias``, the q/k norms when
    ``qk_layernorm``, ``linear_proj`` with its bias when ``add_bias_linear``; with
    ``multi_latent_attention``, megatron's ``MLASelfAttention``: :func:`mla_shapes`);
    ``norm(prefix, width)`` adds a norm's weight (and LayerNorm bias)."""
    get = getter(m)
    h, bias = m.hidden_size, get("add_bias_linear", True)
    attn = m.num_attention_heads * kv_channels(m)
    norm(f"{layer}.input_layernorm")
    if get("multi_latent_attention", False):
        mla_shapes(m, f"{layer}.self_attention", add, norm)
        return
    add(ParamShape(f"{layer}.self_attention.linear_qkv.weight", (qkv_rows(m), h), 0, True))
    if bias or get("add_qkv_bias", False):
        add(ParamShape(f"{layer}.self_attention.linear_qkv.bias", (qkv_rows(m),), 0))
    if get("qk_layernorm", False):
        norm(f"{layer}.self_attention.q_layernorm", kv_channels(m))
        norm(f"{layer}.self_attention.k_layernorm", kv_channels(m))
    add(ParamShape(f"{layer}.self_attention.linear_proj.weight", (h, attn), 1, True))
    if bias:
        add(ParamShape(f"{layer}.self_attention.linear_proj.bias", (h,)))


def mla_shapes(m, attention: str, add: Callable[[ParamShape], None], norm) -> None:
    """Add megatron's ``MLASelfAttention`` (local spec) under ``attention``, in the order of the
    computation. Every projection is a ``ColumnParallelLinear`` (no bias; TP splits its rows,
    whole heads of the up projections, contiguous rows of the down projections, whose output
    megatron gathers) but ``linear_proj``, a ``RowParallelLinear`` (TP splits its
    ``heads x v_head_dim`` columns; a bias when ``add_bias_linear``); GTP shards each weight's
    TP-local rows. With ``qk_layernorm`` the norms of the compressed query (``q_layernorm``,
    ``q_lora_rank`` wide) and key/value (``kv_layernorm``, ``kv_lora_rank``), replicated.

    Rows: ``linear_q_down_proj`` ``q_lora_rank``; ``linear_q_up_proj`` (or, with
    ``q_lora_rank`` null, ``linear_q_proj`` from the hidden state) per head
    ``[qk_head_dim | qk_pos_emb_head_dim]``; ``linear_kv_down_proj``
    ``[kv_lora_rank | qk_pos_emb_head_dim]`` (the key's RoPE part, shared by the heads);
    ``linear_kv_up_proj`` per head ``[qk_head_dim | v_head_dim]``."""
    get = getter(m)
    h, heads = m.hidden_size, m.num_attention_heads
    q_rank, kv_rank = get("q_lora_rank"), int(get("kv_lora_rank"))
    qk, pos, v = int(get("qk_head_dim")), int(get("qk_pos_emb_head_dim")), int(get("v_head_dim"))
    qk_norm = get("qk_layernorm", False)
    if q_rank is None:
        add(ParamShape(f"{attention}.linear_q_proj.weight", (heads * (qk + pos), h), 0, True))
    else:
        add(ParamShape(f"{attention}.linear_q_down_proj.weight", (int(q_rank), h), 0, True))
        if qk_norm:
            norm(f"{attention}.q_layernorm", int(q_rank))
        add(ParamShape(f"{attention}.linear_q_up_proj.weight", (heads * (qk + pos), int(q_rank)),
                       0, True))
    add(ParamShape(f"{attention}.linear_kv_down_proj.weight", (kv_rank + pos, h), 0, True))
    if qk_norm:
        norm(f"{attention}.kv_layernorm", kv_rank)
    add(ParamShape(f"{attention}.linear_kv_up_proj.weight", (heads * (qk + v), kv_rank), 0, True))
    add(ParamShape(f"{attention}.linear_proj.weight", (h, heads * v), 1, True))
    if get("add_bias_linear", True):
        add(ParamShape(f"{attention}.linear_proj.bias", (h,)))
