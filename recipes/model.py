"""Build megatron-core's GPTModel from the config: GPT-2-style or Llama-style blocks, megatron's
local layer spec, and padded vocabulary rows that never reach the loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ``precision.params_dtype`` values and their torch dtypes.
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def padded_vocab_of_config(cfg, tp: int) -> int:
    """Padded vocab rows of a saved run config (a plain mapping with ``data`` and ``model``) at
    tensor-parallel size ``tp``: the tokenizer's vocab padded by :func:`padded_vocab_size`.

    Registered as gtp-recipes' reader of the entry-point group ``gtp.run_config_vocab``, through
    which ``gtp.legacy`` learns the vocab of a checkpoint that records only its run config.

    Raises:
        KeyError, ValueError: ``cfg`` is not a gtp-recipes run config.
    """
    from omegaconf import OmegaConf

    from recipes.data import build_tokenizer

    vocab = build_tokenizer(OmegaConf.create(dict(cfg["data"]))).vocab_size
    return padded_vocab_size(vocab, int(cfg["model"]["make_vocab_size_divisible_by"]), tp)


def gtp_weight_dims(cfg, tensor_model_parallel_size: int) -> dict[str, int]:
    """``{parameter name: TP-local dim 0}`` of every weight megatron shards over the GTP group.

    megatron-core 0.19.2 wraps the ``weight`` of every ``VocabParallelEmbedding``,
    ``ColumnParallelLinear`` and ``RowParallelLinear`` (``megatron.core.tensor_parallel.layers``,
    its ``wrap_module_params_gtp`` calls); never biases, norms or the position embedding. GTP
    slices the TP-local dim 0 (the table is ``recipes.shapes.parameter_shapes``):

    - ``embedding.word_embeddings`` / ``output_layer`` (vocab rows): padded vocab / tp; the output
      layer has no weight of its own when embeddings and output weights are shared;
    - ``linear_qkv`` (column-parallel): (heads + 2 * query groups) * kv_channels / tp;
    - ``linear_fc1`` (column-parallel): ffn / tp, twice that with SwiGLU (gate and up rows);
    - ``linear_proj``, ``linear_fc2`` (row-parallel, TP splits dim 1): hidden, whatever the TP.

    Names are those of ``GPTModel.named_parameters()`` (``recipes.gtp_setup.after_model`` checks
    the built model against this table). The vocab rows are left out when the tokenizer cannot be
    built from the config (other checks report that).
    """
    from recipes.shapes import parameter_shapes, tp_local_shape

    m, tp = cfg.model, tensor_model_parallel_size
    try:
        from recipes.data import build_tokenizer

        vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size,
                                  m.make_vocab_size_divisible_by, tp)
    except ValueError:
        vocab = None
    vocab_rows = ("embedding.word_embeddings.weight", "output_layer.weight")
    return {p.name: tp_local_shape(p, tp)[0] for p in parameter_shapes(m, vocab or tp)
            if p.gtp and (vocab is not None or p.name not in vocab_rows)}


def transformer_config(cfg, layout, use_te: bool | None = None):
    """megatron ``TransformerConfig`` for ``cfg.model`` at ``layout`` (a ``recipes.validate.Layout``).

    ``use_te``: TransformerEngine layers and the quantization recipe's FP8/FP4 fields
    (``recipes.te``); None: when TransformerEngine is importable.
    """
    from megatron.core.transformer import TransformerConfig

    from recipes import te

    if use_te is None:
        use_te = te.transformer_engine_usable()

    m = cfg.model
    dtype = PARAMS_DTYPES[cfg.precision.params_dtype]
    ffn = m.ffn_hidden_size
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.get("num_query_groups"),
        ffn_hidden_size=ffn,
        normalization=m.get("normalization", "LayerNorm"),
        layernorm_epsilon=m.get("layernorm_epsilon", 1e-5),
        add_bias_linear=m.get("add_bias_linear", True),
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        # CPU init draws the full weight from one seed and slices it, so every layout starts
        # from the same logical weights.
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(te.config_fields(cfg.gtp.quantization, use_te))
    if layout.gtp_remat_size > 1:
        kwargs["gtp_weight_remat_size"] = layout.gtp_remat_size
    return TransformerConfig(**kwargs)


def mask_padded_vocab(model, vocab_size: int, padded_size: int) -> None:
    """Keep padded vocabulary rows out of the softmax: their logits become ``-inf``.

    A forward hook on ``model.output_layer`` (a ``ColumnParallelLinear`` over the padded
    vocabulary) fills the logit columns of rows ``>= vocab_size`` with ``-inf`` before
    megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` (``GPTModel._postprocess``) sees
    them: ``exp(-inf) = 0`` drops them from the partition function and their gradient is zero,
    so the loss and every gradient are the same at any padded size (any TP, any
    ``make_vocab_size_divisible_by``). Works in fp32 and bf16 (``-inf`` exists in both).

    Args:
        model: the ``GPTModel`` (its ``output_layer`` yields ``(logits [s, b, padded/tp], bias)``,
            or the full padded width when the output is gathered).
        vocab_size: real (tokenizer) vocabulary rows.
        padded_size: rows of the whole padded output layer.
    """
    from megatron.core import parallel_state

    if vocab_size >= padded_size:
        return

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        first = 0 if width == padded_size else parallel_state.get_tensor_model_parallel_rank() * width
        real = max(0, min(width, vocab_size - first))
        if real == width:
            return output
        return logits.masked_fill(torch.arange(width) >= real, float("-inf")), bias

    model.output_layer.register_forward_hook(hook)


def build_model(cfg, layout, vocab_size: int):
    """Build the GPT model on this rank (after ``parallel_state`` is initialized).

    Args:
        cfg: the run config; ``cfg.model`` gives the shape.
        layout: the resolved ``recipes.validate.Layout``.
        vocab_size: the tokenizer's vocabulary size (padded here for TP).

    Returns:
        ``(model, transformer_config)``: a ``megatron.core.models.gpt.GPTModel`` on CPU.
    """
    from megatron.core.models.gpt import GPTModel

    from recipes import te

    m = cfg.model
    use_te = te.transformer_engine_usable()
    config = transformer_config(cfg, layout, use_te)
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by,
                               layout.tensor_model_parallel_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=te.layer_spec(m, use_te),
        vocab_size=padded,
        max_sequence_length=m.seq_length,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.get("rotary_base", 10000),
        rotary_percent=m.get("rotary_percent", 1.0),
        rope_scaling=m.get("rope_scaling", False),
        rope_scaling_factor=m.get("rope_scaling_factor", 8.0),
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
    )
    # Checkpoints record the real vocabulary (recipes.checkpoint refuses another one).
    model.real_vocab_size = vocab_size
    mask_padded_vocab(model, vocab_size, padded)
    return model, config


def count_parameters(model) -> int:
    """Number of parameters held by this rank (GTP shards count their padded rows)."""
    return sum(p.numel() for p in model.parameters())
