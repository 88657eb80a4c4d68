"""Build megatron-core's GPTModel (local, non-TransformerEngine layer spec) from the config."""

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
    its ``wrap_module_params_gtp`` calls); never biases, norms or the position embedding. GTP slices the
    TP-local dim 0:

    - ``embedding.word_embeddings`` / ``output_layer`` (vocab rows): padded vocab / tp; the output
      layer has no weight of its own when embeddings and output weights are shared;
    - ``linear_qkv`` (column-parallel): (heads + 2 * query groups) * kv_channels / tp = 3 * hidden / tp;
    - ``linear_fc1`` (column-parallel): ffn / tp, twice that with SwiGLU (gate and up rows);
    - ``linear_proj``, ``linear_fc2`` (row-parallel, TP splits dim 1): hidden, whatever the TP.

    Names are those of ``GPTModel.named_parameters()`` (``recipes.gtp_setup.after_model`` checks
    the built model against this table). The vocab rows are left out when the tokenizer cannot be
    built from the config (other checks report that).
    """
    m, tp = cfg.model, tensor_model_parallel_size
    dims: dict[str, int] = {}
    try:
        from recipes.data import build_tokenizer

        vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size,
                                  m.make_vocab_size_divisible_by, tp) // tp
    except ValueError:
        vocab = None
    if vocab is not None:
        dims["embedding.word_embeddings.weight"] = vocab
    for i in range(m.num_layers):
        layer = f"decoder.layers.{i}"
        dims[f"{layer}.self_attention.linear_qkv.weight"] = 3 * m.hidden_size // tp
        dims[f"{layer}.self_attention.linear_proj.weight"] = m.hidden_size
        dims[f"{layer}.mlp.linear_fc1.weight"] = (2 if m.swiglu else 1) * m.ffn_hidden_size // tp
        dims[f"{layer}.mlp.linear_fc2.weight"] = m.hidden_size
    if vocab is not None and not m.share_embeddings_and_output_weights:
        dims["output_layer.weight"] = vocab
    return dims


def transformer_config(cfg, layout):
    """megatron ``TransformerConfig`` for ``cfg.model`` at ``layout`` (a ``recipes.validate.Layout``)."""
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    dtype = PARAMS_DTYPES[cfg.precision.params_dtype]
    ffn = m.ffn_hidden_size
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=ffn,
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
    if layout.gtp_remat_size > 1:
        kwargs["gtp_weight_remat_size"] = layout.gtp_remat_size
    return TransformerConfig(**kwargs)


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
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(cfg, layout)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=padded_vocab_size(
            vocab_size, cfg.model.make_vocab_size_divisible_by, layout.tensor_model_parallel_size
        ),
        max_sequence_length=cfg.model.seq_length,
        position_embedding_type=cfg.model.position_embedding_type,
        share_embeddings_and_output_weights=cfg.model.share_embeddings_and_output_weights,
    )
    return model, config


def count_parameters(model) -> int:
    """Number of parameters held by this rank (GTP shards count their padded rows)."""
    return sum(p.numel() for p in model.parameters())
