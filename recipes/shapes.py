"""The parameters megatron's ``GPTModel`` (local layer spec) holds for a config, without building it.

One table, :func:`parameter_shapes`, gives every parameter's name (as
``GPTModel.named_parameters()``), its full logical shape, the dim tensor parallelism splits and
whether GTP shards it; :func:`local_shape` turns an entry into the shape one rank holds. The
pre-launch GTP checks, the dry run and the published parameter counts of the presets all read it,
and a multi-process test compares it with built models at several layouts.
"""

from __future__ import annotations

import math
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
    # A routed expert's weight: split over expert_model_parallel_size (whole experts), its
    # tp_axis over expert_tensor_parallel_size, GTP-sharded over expert_gtp_remat_size.
    expert: bool = False


def query_groups(m) -> int:
    """K/V head groups: ``num_query_groups``, or one per attention head when null."""
    groups = m.get("num_query_groups") if hasattr(m, "get") else getattr(m, "num_query_groups", None)
    return groups or m.num_attention_heads


def _get(m):
    return m.get if hasattr(m, "get") else lambda k, d=None: getattr(m, k, d)


def kv_channels(m) -> int:
    """Width of one attention head: ``model.kv_channels``, or hidden / heads when null."""
    return _get(m)("kv_channels") or m.hidden_size // m.num_attention_heads


def qkv_rows(m) -> int:
    """Full dim 0 of ``linear_qkv``: ``(heads + 2 * groups) * kv_channels`` (megatron
    ``SelfAttention``: per query group, its query heads then K then V)."""
    return (m.num_attention_heads + 2 * query_groups(m)) * kv_channels(m)


def is_moe_layer(m, layer: int) -> bool:
    """Whether 0-based ``layer`` has an MoE MLP: ``num_moe_experts`` set and ``layer`` a multiple
    of ``moe_layer_freq`` (megatron's int ``moe_layer_freq``: layer i is MoE when
    ``i % freq == 0``)."""
    get = _get(m)
    if not get("num_moe_experts"):
        return False
    return layer % int(get("moe_layer_freq", 1) or 1) == 0


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
    get = _get(m)
    h, ffn = m.hidden_size, m.ffn_hidden_size
    bias = get("add_bias_linear", True)
    norm_bias = get("normalization", "LayerNorm") == "LayerNorm"
    gated = 2 if m.swiglu else 1
    attn = m.num_attention_heads * kv_channels(m)
    out = [ParamShape("embedding.word_embeddings.weight", (padded_vocab, h), 0, True)]
    if get("position_embedding_type", "learned_absolute") == "learned_absolute":
        out.append(ParamShape("embedding.position_embeddings.weight", (m.seq_length, h)))

    def norm(prefix, width=h):
        out.append(ParamShape(f"{prefix}.weight", (width,)))
        if norm_bias:
            out.append(ParamShape(f"{prefix}.bias", (width,)))

    def mlp(prefix, width, expert=False):
        out.append(ParamShape(f"{prefix}.linear_fc1.weight", (gated * width, h), 0, True, expert))
        if bias:
            out.append(ParamShape(f"{prefix}.linear_fc1.bias", (gated * width,), 0, False, expert))
        out.append(ParamShape(f"{prefix}.linear_fc2.weight", (h, width), 1, True, expert))
        if bias:
            out.append(ParamShape(f"{prefix}.linear_fc2.bias", (h,), None, False, expert))

    for i in range(m.num_layers):
        layer = f"decoder.layers.{i}"
        norm(f"{layer}.input_layernorm")
        out.append(ParamShape(f"{layer}.self_attention.linear_qkv.weight", (qkv_rows(m), h), 0, True))
        if bias:
            out.append(ParamShape(f"{layer}.self_attention.linear_qkv.bias", (qkv_rows(m),), 0))
        if get("qk_layernorm", False):
            norm(f"{layer}.self_attention.q_layernorm", kv_channels(m))
            norm(f"{layer}.self_attention.k_layernorm", kv_channels(m))
        out.append(ParamShape(f"{layer}.self_attention.linear_proj.weight", (h, attn), 1, True))
        if bias:
            out.append(ParamShape(f"{layer}.self_attention.linear_proj.bias", (h,)))
        norm(f"{layer}.pre_mlp_layernorm")
        if not is_moe_layer(m, i):
            mlp(f"{layer}.mlp", ffn)
            continue
        # megatron's MoELayer: TopKRouter (weight [experts, hidden], replicated), SequentialMLP
        # (local_experts.<i>, an MLP each), then the optional SharedExpertMLP.
        experts = int(get("num_moe_experts"))
        out.append(ParamShape(f"{layer}.mlp.router.weight", (experts, h)))
        width = get("moe_ffn_hidden_size") or ffn
        for e in range(experts):
            mlp(f"{layer}.mlp.experts.local_experts.{e}", width, expert=True)
        shared = get("moe_shared_expert_intermediate_size")
        if shared:
            mlp(f"{layer}.mlp.shared_experts", shared)
    norm("decoder.final_layernorm")
    if not m.share_embeddings_and_output_weights:
        out.append(ParamShape("output_layer.weight", (padded_vocab, h), 0, True))
    return out


def parameter_counts(m, padded_vocab: int) -> tuple[int, int]:
    """``(total, active)`` parameters of the model: active counts, of each MoE layer's routed
    experts, the ``moe_router_topk`` a token goes through (``topk / num_moe_experts`` of them),
    and everything else whole. Dense models: ``(total, total)``."""
    shapes = parameter_shapes(m, padded_vocab)
    total, experts = count(shapes), count([p for p in shapes if p.expert])
    if not experts:
        return total, total
    get = _get(m)
    return total, total - experts + experts * int(get("moe_router_topk")) // int(get("num_moe_experts"))


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


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rows after padding: ``vocab_size`` rounded up to a multiple of
    ``lcm(divisible_by, tp)``.

    Megatron-LM (``_vocab_size_with_padding``) uses ``divisible_by * tp``, which changes the
    padded size, hence the softmax over padded logits and the loss, when TP changes. With the lcm
    the padded size is the same at every TP dividing ``divisible_by``, so a run resumed at another
    TP computes exactly the same function.
    """
    multiple = math.lcm(divisible_by, tp)
    return ((vocab_size + multiple - 1) // multiple) * multiple


def gtp_weight_dims(cfg, tensor_model_parallel_size: int) -> dict[str, int]:
    """``{parameter name: TP-local dim 0}`` of every weight megatron shards over the GTP group.

    megatron-core 0.19.2 wraps the ``weight`` of every ``VocabParallelEmbedding``,
    ``ColumnParallelLinear`` and ``RowParallelLinear`` (``megatron.core.tensor_parallel.layers``,
    its ``wrap_module_params_gtp`` calls); never biases, norms or the position embedding. GTP
    slices the TP-local dim 0 (the table is :func:`parameter_shapes`):

    - ``embedding.word_embeddings`` / ``output_layer`` (vocab rows): padded vocab / tp; the output
      layer has no weight of its own when embeddings and output weights are shared;
    - ``linear_qkv`` (column-parallel): (heads + 2 * query groups) * kv_channels / tp;
    - ``linear_fc1`` (column-parallel): ffn / tp, twice that with SwiGLU (gate and up rows);
    - ``linear_proj``, ``linear_fc2`` (row-parallel, TP splits dim 1): hidden, whatever the TP;
    - routed experts' ``linear_fc1`` / ``linear_fc2`` only under expert GTP
      (``gtp.expert_gtp_remat_size > 1``; megatron shards them over the expert GTP group), as one
      expert-parallel rank holds them, with expert tensor parallelism instead of TP.

    Names are those of ``GPTModel.named_parameters()`` (``recipes.gtp_setup.after_model`` checks
    the built model against this table). The vocab rows are left out when the tokenizer cannot be
    built from the config (other checks report that).
    """
    m, tp = cfg.model, tensor_model_parallel_size
    try:
        from recipes.data import build_tokenizer

        vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size,
                                  m.make_vocab_size_divisible_by, tp)
    except ValueError:
        vocab = None
    vocab_rows = ("embedding.word_embeddings.weight", "output_layer.weight")
    dense = {p.name: tp_local_shape(p, tp)[0] for p in parameter_shapes(m, vocab or tp)
             if p.gtp and not p.expert and (vocab is not None or p.name not in vocab_rows)}
    return {**dense, **_expert_gtp_weight_dims(cfg, tp)}


def _expert_gtp_weight_dims(cfg, tp: int) -> dict[str, int]:
    """Routed-expert entries of :func:`gtp_weight_dims`: only under expert GTP
    (``gtp.expert_gtp_remat_size > 1``), named as one EP rank holds them
    (``local_experts.0 .. num_moe_experts / ep - 1``), dim 0 after expert tensor parallelism."""
    par = cfg.parallelism
    if cfg.gtp.get("expert_gtp_remat_size", 1) <= 1 or not cfg.model.get("num_moe_experts"):
        return {}
    etp = par.get("expert_tensor_parallel_size") or tp
    local = int(cfg.model.num_moe_experts) // int(par.get("expert_model_parallel_size", 1))
    out = {}
    for p in parameter_shapes(cfg.model, tp):
        if p.expert and p.gtp and int(p.name.split(".local_experts.")[1].split(".")[0]) < local:
            out[p.name] = tp_local_shape(p, etp)[0]
    return out
