"""Build the model of a run: the model family's megatron module (``recipes/families/``) with the
run-wide ``TransformerConfig`` fields (parallel sizes, precision, fusions), the same initial
weights at every layout, and padded vocabulary rows that never reach the loss."""

from __future__ import annotations

import dataclasses

import torch

from ckpt.io.chunks import model_chunks
from recipes.model import te
from recipes.families import family_of
from recipes.model.shapes import padded_vocab_size

# ``precision.params_dtype`` values and their torch dtypes.
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer_config(cfg, parallel_dims, use_te: bool | None = None):
    """megatron ``TransformerConfig`` for ``cfg.model`` at ``parallel_dims``.

    ``use_te``: TransformerEngine layers and the quantization recipe's FP8/FP4 fields
    (``recipes.model.te``); None: when TransformerEngine is importable. A model with
    ``multi_latent_attention`` gets megatron's ``MLATransformerConfig`` (its family's fields
    carry the MLA ones: ``recipes.families.gpt.model.mla_fields``).
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if use_te is None:
        use_te = te.uses_transformer_engine(cfg)

    dtype = PARAMS_DTYPES[cfg.precision.params_dtype]
    kwargs = dict(
        **family_of(cfg.model).transformer_config_fields(cfg.model, parallel_dims),
        tensor_model_parallel_size=parallel_dims.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_dims.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel_dims.virtual_pipeline_model_parallel_size,
        # CPU init draws the full weight from one seed and slices it, so every layout starts
        # from the same logical weights.
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        sequence_parallel=parallel_dims.sequence_parallel,
        context_parallel_size=parallel_dims.context_parallel_size,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=bool(cfg.train.get("calculate_per_token_loss", False)),
    )
    if (parallel_dims.virtual_pipeline_model_parallel_size
            and parallel_dims.pipeline_model_parallel_size == 2):
        # At pp2 the previous and the next stage are the same peer, and the interleaved schedule
        # sends an activation and a gradient to it at once. Batched p2p ops
        # (p2p_communication._batched_p2p_ops) post them on one group in the same order on both
        # ranks, so the peer's activation receive takes the gradient. megatron's unbatched ops
        # (p2p_communication._p2p_ops) put the two directions on two groups at pp2.
        kwargs["batch_p2p_comm"] = False
    recompute = cfg.model.get("recompute_granularity")
    if recompute:
        kwargs["recompute_granularity"] = recompute
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(te.config_fields(cfg.gtp.quantization, use_te,
                                   cfg.gtp.get("fp8_param_gather", False)))
    if parallel_dims.gtp_remat_size > 1:
        kwargs["gtp_weight_remat_size"] = parallel_dims.gtp_remat_size
    if kwargs.get("multi_latent_attention"):
        return MLATransformerConfig(**kwargs)
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
        model: the ``GPTModel`` or ``LLaVAModel`` (its or its ``language_model`` 's
            ``output_layer`` yields ``(logits [s, b, padded/tp], bias)``,
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
        return logits.masked_fill(torch.arange(width, device=logits.device) >= real,
                                 float("-inf")), bias

    # A vision-language model's output layer is its language model's.
    output_layer = getattr(model, "output_layer", None) or model.language_model.output_layer
    output_layer.register_forward_hook(hook)


def _chunk(cfg, config, vocab: int, pre: bool, post: bool, vp_stage, tied: bool, use_te: bool):
    family = family_of(cfg.model)
    spec = family.layer_spec(cfg.model, config, use_te, vp_stage)
    if config.multi_latent_attention:
        from mcore_compat.mla_local import with_local_mla

        spec = with_local_mla(spec)  # megatron's local MLA, built and with tp1's gradients
    return family.build(cfg.model, config, spec, vocab, pre, post, vp_stage, tied)


def _draw_like_layers_before(cfg, config, vocab: int, num_layers: int, use_te: bool) -> None:
    """Advance the RNGs (torch's and megatron's tracker) exactly as building the embedding and
    the first ``num_layers`` layers of the whole model does: build that prefix (one pipeline
    stage, no output layer) and drop it. Only random draws matter; sizes and order are the
    pp1 model's, so each layer gets the weights it gets at pp1."""
    # No MTP layers: megatron would build them in the prefix on the last stage (it asks
    # parallel_state, not the config, which stage this is), drawing them before this chunk's.
    prefix = dataclasses.replace(config, num_layers=num_layers, pipeline_model_parallel_size=1,
                                 virtual_pipeline_model_parallel_size=None, mtp_num_layers=None)
    # Untied: a tied embedding would wait for its output-layer peer in megatron's all-reduce.
    _chunk(cfg, prefix, vocab, True, False, None, False, use_te)


def build_model(cfg, parallel_dims, vocab_size: int, reseed=lambda: None):
    """Build this rank's model chunks (after ``parallel_state`` is initialized).

    Under pipeline parallelism each chunk holds megatron's share of the layers
    (``transformer_layer.get_transformer_layer_offset``: ``num_layers / (pp * vpp)`` per chunk,
    chunk ``v`` of stage ``p`` starting at layer ``(v * pp + p) * that``); the embedding lives on
    the first chunk of stage 0, the output layer and loss on the last chunk of the last stage.

    Args:
        cfg: the run config; ``cfg.model`` gives the shape.
        parallel_dims: the resolved ``recipes.config.parallel_dims.ParallelDims``.
        vocab_size: the tokenizer's vocabulary size (padded here for TP).
        reseed: re-seeds every RNG with the run's seed (called before each chunk under pipeline
            parallelism).

    Returns:
        ``(chunks, transformer_config)``: a list of the family's megatron modules on CPU
        (``GPTModel`` for the gpt and moe families), one per virtual pipeline stage (one without
        vpp).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    use_te = te.uses_transformer_engine(cfg)
    config = transformer_config(cfg, parallel_dims, use_te)
    vpp = parallel_dims.virtual_pipeline_model_parallel_size
    vocab = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by,
                              parallel_dims.tensor_model_parallel_size)
    family = family_of(cfg.model)
    seed = torch.initial_seed()  # the run's seed (worker.set_seed), for the experts' draws
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        if parallel_dims.pipeline_model_parallel_size > 1:
            # Same initial weights at every layout: replay the draws of the layers before this
            # chunk, from the run's seed, as the pp1 model would have made them.
            reseed()
            offset = get_transformer_layer_offset(config, vp_stage=stage)
            if offset:
                with family.building():
                    _draw_like_layers_before(cfg, config, vocab, offset, use_te)
        with family.building():
            chunk = _chunk(cfg, config, vocab, pre, post, stage,
                           cfg.model.share_embeddings_and_output_weights, use_te)
        if family.init_weights:
            family.init_weights(chunk, config, seed)
        # Checkpoints record the real vocabulary (ckpt.io refuses another one).
        chunk.real_vocab_size = vocab_size
        if post:
            mask_padded_vocab(chunk, vocab_size, vocab)
        chunks.append(chunk)
    return chunks, config


def count_parameters(model) -> int:
    """Number of parameters held by this rank (GTP shards count their padded rows)."""
    return sum(p.numel() for chunk in model_chunks(model) for p in chunk.parameters())
