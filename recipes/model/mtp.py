"""Multi-token prediction in a run: the checks before launch and the ``mtp_N loss`` metrics.

The MTP layers themselves are megatron's (``MultiTokenPredictionBlock``, built by the GPT
family's ``GPTModel``, or the hybrid family's ``HybridModel`` from the pattern's ``/`` parts, on
the last pipeline stage); their loss reaches the gradients through
megatron's ``MTPLossAutoScaler``, whose scale megatron's schedule sets. ``docs/mtp.md`` says
more.
"""

from __future__ import annotations

from recipes.config.errors import ConfigError
from recipes.metrics.logger import add_to_each_step


def mtp_num_layers(model_cfg) -> int:
    """The config's MTP layers (``model.mtp_num_layers``; null counts as 0)."""
    return int(model_cfg.get("mtp_num_layers") or 0)


def check(cfg, parallel_dims) -> None:
    """MTP rules, before any process starts.

    Raises:
        ConfigError: a negative ``mtp_num_layers`` or ``mtp_loss_scaling_factor``; MTP with
            context parallelism (not run here); under pipeline parallelism, learned absolute
            positions or tied embeddings, which megatron-core 0.19.2 does not keep in step on
            the MTP stage: it copies and syncs the word embedding there, but not the position
            embedding, and it allocates an unused output weight there for a tied model.
    """
    m = cfg.model
    n = m.get("mtp_num_layers")
    if n is None or n == 0:
        return
    if n < 0:
        raise ConfigError(f"model.mtp_num_layers={n} must be >= 0 (null or 0: no MTP)")
    if m.get("mtp_loss_scaling_factor", 0.1) < 0:
        raise ConfigError(f"model.mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} must be "
                          f">= 0")
    if parallel_dims.context_parallel_size > 1:
        raise ConfigError(f"model.mtp_num_layers={n} with parallelism.context_parallel_size="
                          f"{parallel_dims.context_parallel_size}: multi-token prediction runs "
                          f"here without context parallelism (context_parallel_size=1)")
    if parallel_dims.pipeline_model_parallel_size == 1:
        return
    pp = f"pipeline_model_parallel_size={parallel_dims.pipeline_model_parallel_size}"
    if m.position_embedding_type == "learned_absolute":
        raise ConfigError(
            f"model.mtp_num_layers={n} at {pp} needs model.position_embedding_type=rope (or "
            f"none): the MTP layers on the last stage would train their own copy of the learned "
            f"position embedding, which megatron-core 0.19.2 never syncs with the first stage's")
    if m.share_embeddings_and_output_weights:
        raise ConfigError(
            f"model.mtp_num_layers={n} at {pp} needs model.share_embeddings_and_output_weights="
            f"false: megatron-core 0.19.2 gives the MTP stage an output weight that a tied "
            f"model never uses and its checkpoint cannot place")


def reduce_mtp_loss(model_cfg, num_microbatches: int) -> dict:
    """The iteration's MTP losses from megatron's ``MTPLossLoggingHelper`` tracker, then the
    tracker cleared. Collective: every rank calls it after each step.

    As megatron's ``MTPLossLoggingHelper.track_mtp_metrics`` (``training.py`` passes it
    ``1 / num_microbatches``): each MTP layer's per-micro-batch mean loss, summed over the
    micro-batches, averaged over the data group (with context parallelism), times
    ``1 / num_microbatches``. The tracker exists on the MTP stage only, so the values are summed
    over the pipeline group first (zeros elsewhere), and every rank returns the same figures.
    The losses are before ``mtp_loss_scaling_factor``.

    Returns:
        ``{"mtp_1 loss": float, ...}``, one entry per MTP layer (megatron's names).
    """
    # Here, not at the top: the launcher validates configs (check) without torch or megatron.
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from gtp.collectives import collective_device

    n = mtp_num_layers(model_cfg)
    tracker = MTPLossLoggingHelper.tracker
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    values = tracker.get("loss_values")
    values = torch.zeros(n) if values is None else values.detach().float()
    values = values.to(collective_device(dp), copy=True)  # NCCL takes no CPU tensor
    dist = torch.distributed
    dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(values, group=dp)  # gloo has no AVG: a sum divided by the group size
    values = values.cpu() / (dist.get_world_size(dp) * num_microbatches)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return {f"mtp_{i + 1} loss": float(v) for i, v in enumerate(values)}


def attach_metrics(cfg, state, logger) -> None:
    """Add ``mtp_N loss`` (:func:`reduce_mtp_loss`) to every logged iteration of a run with
    MTP layers: megatron's tracker is cleared when a step starts (``optimizer.zero_grad``),
    reduced on every rank after the optimizer step, and merged into the metrics rank 0's
    ``logger`` writes (metrics.jsonl and wandb). Nothing happens without MTP."""
    if not mtp_num_layers(cfg.model):
        return
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    add_to_each_step(state.optimizer, logger, MTPLossLoggingHelper.clean_metrics_in_tracker,
                     lambda: reduce_mtp_loss(cfg.model, state.num_microbatches))
