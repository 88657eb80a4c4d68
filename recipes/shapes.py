"""The parameters megatron's ``GPTModel`` (local layer spec) holds for a config, without building it.

One table, :func:`parameter_shapes`, gives every parameter's name (as
``GPTModel.named_parameters()``), its full logical shape, the dim tensor parallelism splits and
whether GTP shards it; :func:`local_shape` turns an entry into the shape one rank holds. The
pre-launch GTP checks, the dry run and the published parameter counts of the presets all read it,
and a multi-process test compares it with built models at several layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model.

    Attributes:
        name: ``GPTModel.named_parameters()`` name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``.
        shape: full logical shape (all TP ranks together, no GTP padding).
        tp_axis: dim split over TP ranks (0 column-parallel / vocab rows, 1 row-parallel), None
            when every TP rank holds all of it.
        gtp: GTP shards its TP-local dim 0 (megatron-core 0.19.2 wraps the ``weight`` of every
            ``VocabParallelEmbedding``, ``ColumnParallelLinear`` and ``RowParallelLinear``).
    """

    name: str
    shape: tuple[int, ...]
    tp_axis: Optional[int] = None
    gtp: bool = False


def query_groups(m) -> int:
    """K/V head groups: ``num_query_groups``, or one per attention head when null."""
    groups = m.get("num_query_groups") if hasattr(m, "get") else getattr(m, "num_query_groups", None)
    return groups or m.num_attention_heads


def qkv_rows(m) -> int:
    """Full dim 0 of ``linear_qkv``: ``(heads + 2 * groups) * kv_channels``, kv_channels =
    hidden / heads (megatron ``SelfAttention``: per query group, its query heads then K then V)."""
    kv_channels = m.hidden_size // m.num_attention_heads
    return (m.num_attention_heads + 2 * query_groups(m)) * kv_channels


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of megatron's ``GPTModel`` with the local layer spec, in module order.

    Args:
        m: the ``model`` config (``ModelConfig`` fields).
        padded_vocab: rows of the embedding and output layer (the padded vocabulary).

    Returns:
        The :class:`ParamShape` list. Norm weights (and LayerNorm biases), linear biases when
        ``add_bias_linear``, the learned position embedding and the output layer (absent when
        embeddings and output weights are shared) follow megatron's module tree.
    """
    get = m.get if hasattr(m, "get") else lambda k, d=None: getattr(m, k, d)
    h, ffn = m.hidden_size, m.ffn_hidden_size
    bias = get("add_bias_linear", True)
    norm_bias = get("normalization", "LayerNorm") == "LayerNorm"
    fc1 = (2 if m.swiglu else 1) * ffn
    out = [ParamShape("embedding.word_embeddings.weight", (padded_vocab, h), 0, True)]
    if get("position_embedding_type", "learned_absolute") == "learned_absolute":
        out.append(ParamShape("embedding.position_embeddings.weight", (m.seq_length, h)))

    def norm(prefix):
        out.append(ParamShape(f"{prefix}.weight", (h,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}.bias", (h,)))

    for i in range(m.num_layers):
        layer = f"decoder.layers.{i}"
        norm(f"{layer}.input_layernorm")
        out.append(ParamShape(f"{layer}.self_attention.linear_qkv.weight", (qkv_rows(m), h), 0, True))
        if bias:
            out.append(ParamShape(f"{layer}.self_attention.linear_qkv.bias", (qkv_rows(m),), 0))
        out.append(ParamShape(f"{layer}.self_attention.linear_proj.weight", (h, h), 1, True))
        if bias:
            out.append(ParamShape(f"{layer}.self_attention.linear_proj.bias", (h,)))
        norm(f"{layer}.pre_mlp_layernorm")
        out.append(ParamShape(f"{layer}.mlp.linear_fc1.weight", (fc1, h), 0, True))
        if bias:
            out.append(ParamShape(f"{layer}.mlp.linear_fc1.bias", (fc1,), 0))
        out.append(ParamShape(f"{layer}.mlp.linear_fc2.weight", (h, ffn), 1, True))
        if bias:
            out.append(ParamShape(f"{layer}.mlp.linear_fc2.bias", (h,)))
    norm("decoder.final_layernorm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out


def count(shapes: list[ParamShape]) -> int:
    """Total elements of the full logical shapes."""
    total = 0
    for p in shapes:
        n = 1
        for d in p.shape:
            n *= d
        total += n
    return total


def tp_local_shape(p: ParamShape, tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds before GTP: ``tp_axis`` divided by ``tp``."""
    shape = list(p.shape)
    if p.tp_axis is not None:
        shape[p.tp_axis] //= tp
    return tuple(shape)


def local_shape(p: ParamShape, tp: int, g: int, pad_for_alignment: int) -> tuple[tuple[int, ...], int]:
    """``(shape on one rank, GTP padding rows)`` at ``tp`` x GTP degree ``g``.

    A GTP weight's TP-local dim 0 is padded (``gtp.layout.gtp_padding``, megatron's
    ``gtp_remat_shard_dim0`` math) and split over ``g`` ranks; every rank holds the same shape.

    Raises:
        ValueError: ``pad_for_alignment == 0`` and the TP-local dim 0 does not divide by ``g``.
    """
    shape = tp_local_shape(p, tp)
    if not (p.gtp and g > 1):
        return shape, 0
    from gtp.layout import gtp_padding

    pad_length, rows = gtp_padding(shape[0], g, pad_for_alignment)
    return (rows, *shape[1:]), pad_length
