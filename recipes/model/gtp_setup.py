"""Where a run switches GTP on: the hooks the worker calls around model construction.

With ``gtp.gtp_remat_size == 1`` every hook does nothing.

megatron and the modules that import it are imported inside the hooks (start-up time:
``recipes.config.validate`` imports :func:`overlap_settings` before launch).
"""

from __future__ import annotations

from gtp import alignment, tied_output
from recipes.families import gtp_weight_dims
from recipes.model import te
from recipes.model.mtp import mtp_num_layers


def before_model(cfg, parallel_dims) -> None:
    """Install the portable backend (when TransformerEngine is not usable), the num-zeros
    patch (``gtp.grad_stats``: GTP padding rows are not gradient elements) and, for tied
    embeddings, ``gtp.tied_output`` (the output layer takes the embedding's GTP shard), run
    megatron's recipe hook, then apply the resolved ``pad_for_alignment`` (megatron 0.19.2
    would keep 16).

    First, at every layout (GTP off included): ``checkpoint.format`` picks how GTP weights
    are checkpointed ("logical": ``ckpt.format.logical_format`` patch installed; "stock": megatron 0.19.2)."""
    from ckpt.format import logical_format

    logical_format.configure(cfg.checkpoint.get("format", "logical"))
    if not parallel_dims.uses_gtp:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    from gtp import backend, grad_stats

    backend.install()
    grad_stats.install()
    if cfg.model.share_embeddings_and_output_weights:
        tied_output.install()  # the output layer takes the tied embedding's GTP shard
    quant = cfg.gtp.quantization
    gtp_impl.configure_gtp_remat_from_recipe(
        fp4=quant == "nvfp4",
        fp8=quant in ("fp8", "mxfp8"),
        fp8_recipe="mxfp8" if quant == "mxfp8" else None,
        # The gtp_remat reduce-scatter sums (not averages) under per-token loss.
        calculate_per_token_loss=bool(cfg.train.get("calculate_per_token_loss", False)),
    )
    alignment.apply_pad_for_alignment(parallel_dims.pad_for_alignment)

    gtp_impl.update_gtp_config(**overlap_settings(
        cfg.gtp, parallel_dims.pipeline_model_parallel_size, te.uses_transformer_engine(cfg),
        reused=weight_reuse(cfg.model)))


OVERLAP_FIELDS = ("weight_prefetch", "async_reduction")


def weight_reuse(model_cfg) -> str | None:
    """The ``model`` setting under which a forward uses a GTP weight twice (None: none):
    tied embeddings (the output layer computes with the embedding's weight) or multi-token
    prediction (each MTP layer computes logits with the output layer again and looks up the
    embedding again)."""
    if model_cfg.share_embeddings_and_output_weights:
        return "model.share_embeddings_and_output_weights=true"
    if mtp_num_layers(model_cfg):
        return f"model.mtp_num_layers={mtp_num_layers(model_cfg)}"
    return None


def overlap_settings(gtp_cfg, pipeline_model_parallel_size: int, te_usable: bool,
                     reused: str | None = None) -> dict:
    """megatron's ``GTP_CONFIG.weight_prefetch`` / ``async_reduction`` for a run.

    Both overlap GTP's collectives with compute (megatron's prefetch chain). With
    TransformerEngine both are megatron's defaults (on). On the gloo backend (``gtp.backend``):

    * ``async_reduction`` (weight-gradient reduce-scatters travel while the backward goes on,
      the exchange's async sends and receives): on by default without pipeline parallelism.
      Under pipeline parallelism the collectives run in order: megatron's chains follow one
      model's layer order and a pipeline schedule interleaves micro-batches and model chunks.
    * ``weight_prefetch`` (the next weight's all-gather issued while this layer computes): off,
      and refused when asked for. megatron orders the prefetch into its reused gather buffers
      with CUDA streams and events, which have no CPU counterpart here: with gloo's async
      gathers the same run gave different losses from one launch to the next.

    When a forward uses a GTP weight twice (``reused``, :func:`weight_reuse`: tied embeddings,
    whose output layer computes with the embedding's weight, ``gtp.tied_output``; MTP layers,
    which use the output layer and the embedding again), on any backend, both are off and
    refused: the second use falls outside the chain's one-use-per-weight order, so a deferred
    reduce-scatter would wait on a weight whose gradient does not exist yet (megatron-core
    0.19.2 fails with ``KeyError: None`` in ``wgrad_reduce_scatter``), and a prefetch would
    leave a gathered copy stale across the optimizer step.

    Returns:
        ``{"weight_prefetch": bool, "async_reduction": bool}``.

    Raises:
        ValueError: an explicit ``true`` that the gloo backend cannot run exactly.
    """
    why = {} if te_usable else {"weight_prefetch": (
        "the gloo backend has no CUDA streams to order megatron's prefetch into its reused "
        "gather buffers (runs are not reproducible)")}
    if not te_usable and pipeline_model_parallel_size > 1:
        why["async_reduction"] = (
            f"without TransformerEngine GTP's collectives run in order under pipeline "
            f"parallelism (pipeline_model_parallel_size={pipeline_model_parallel_size})")
    if reused:
        for name in OVERLAP_FIELDS:
            why[name] = (f"with {reused} the model uses a GTP weight a second time in one "
                         f"forward, outside megatron's chain order")
    out = {}
    for name in OVERLAP_FIELDS:
        value = gtp_cfg.get(name)
        if value is None:
            value = name not in why
        elif value and name in why:
            raise ValueError(f"gtp.{name}=true cannot run here: {why[name]}; set gtp.{name}="
                             f"null or false")
        out[name] = bool(value)
    return out


def after_model(model, parallel_dims, cfg) -> None:
    """Verify the built model's GTP shards carry the resolved alignment, and that the weights
    megatron sharded are exactly those pre-launch validation checked for ``cfg`` (the run
    config; ``recipes.families.gtp_weight_dims``); rank 0 prints what it verified.

    Raises:
        RuntimeError: a GTP shard's padding differs from ``layout.pad_for_alignment``, or the
            sharded weights (name, TP-local dim 0) differ from the validated ones.
    """
    if parallel_dims.gtp_remat_size == 1:
        return
    import torch
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import (GTP_CONFIG,
                                                                              is_gtp_param)

    checked = alignment.check_pad_applied(model, parallel_dims.pad_for_alignment)
    built = {name: p._unsharded_shape[0] for name, p in model.named_parameters() if is_gtp_param(p)}
    expected = _stage_share(gtp_weight_dims(cfg, parallel_dims.tensor_model_parallel_size), model,
                            cfg)
    if built != expected:
        diff = sorted(set(built.items()) ^ set(expected.items()))
        raise RuntimeError(
            "GTP-sharded weights (name, TP-local dim 0) differ from what pre-launch validation "
            f"checked (recipes.families.gtp_weight_dims): {diff}"
        )
    if torch.distributed.get_rank() == 0:
        pad_rows = sum(p.pad_length for p in model.parameters() if is_gtp_param(p))
        print(f"> GTP: {checked} weights sharded over "
              f"gtp_remat_size={parallel_dims.gtp_remat_size}, "
              f"pad_for_alignment={parallel_dims.pad_for_alignment} verified on the built model "
              f"({pad_rows} padding rows in all); weight_prefetch={GTP_CONFIG.weight_prefetch}, "
              f"async_reduction={GTP_CONFIG.async_reduction}", flush=True)


def _stage_share(dims: dict, chunk, cfg) -> dict:
    """The entries of ``gtp_weight_dims`` (whole model) that pipeline chunk ``chunk`` holds,
    under its local names: its layers (local ``decoder.layers.i`` is megatron's layer number
    ``layer_number - 1`` of the whole model: a hybrid model's layers differ), the embedding on
    the first stage (and on the stage of the MTP layers, where megatron keeps a copy), the MTP
    layers and the output layer on the last one (a copy of the tied embedding there when the
    embedding lives on another stage)."""
    # A LLaVAModel has no decoder of its own (its weights are all prefixed; no pipeline stages).
    decoder = getattr(chunk, "decoder", None)
    local = ({layer.layer_number - 1: i for i, layer in enumerate(decoder.layers)}
             if decoder is not None else {})
    mtp = getattr(chunk, "mtp_process", False)
    out = {}
    for name, dim in dims.items():
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            if int(parts[2]) in local:
                parts[2] = str(local[int(parts[2])])
                out[".".join(parts)] = dim
        elif name.startswith("embedding."):
            if chunk.pre_process or mtp:
                out[name] = dim
        elif name.startswith("mtp."):
            if mtp:
                out[name] = dim
        elif chunk.post_process:
            out[name] = dim
    tied = cfg.model.share_embeddings_and_output_weights
    if tied and chunk.post_process and not chunk.pre_process:
        out["output_layer.weight"] = dims["embedding.word_embeddings.weight"]
    return out


def after_ddp(ddp_model, parallel_dims) -> None:
    """megatron's ``classify_gtp_remat_chains``: tag GTP params before the first forward."""
    if not parallel_dims.uses_gtp:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    gtp_impl.classify_gtp_remat_chains(ddp_model)
