"""Per-layer tokens-per-expert figures of an MoE run: how evenly each layer's router spreads the
iteration's tokens over its experts.

What is counted is what megatron's ``TopKRouter._apply_expert_bias`` adds to
``local_tokens_per_expert`` (the count its expert-bias update balances): the router's
``routing_map`` (tokens x experts, one True per token and chosen expert) summed over tokens, in
training forwards with gradients enabled only (not in evaluation, nor twice under activation
recomputation), then summed over the tensor x data x context-parallel group as megatron's
``moe_utils.get_updated_expert_bias`` does and over the pipeline stages (each holds its own
layers). ``docs/moe.md`` names the metrics.
"""

from __future__ import annotations

from functools import partial

import torch

from gtp.collectives import collective_device
from recipes.metrics.logger import add_to_each_step
from recipes.model.build import model_chunks
from recipes.model.moe import aux_loss_name, is_moe, moe_decoder_layers, reduce_aux_loss
from recipes.model.mtp import mtp_num_layers


def metric_names(layer: int) -> tuple[str, str]:
    """The two metrics of MoE layer ``layer`` (0-based, as ``grad-norm/layer-<i>``): the most and
    the fewest tokens any expert received, each over the mean per expert (1.0 everywhere:
    perfectly balanced; ``max-to-mean`` = number of experts: every token went to one)."""
    return (f"tokens-per-expert/layer-{layer}/max-to-mean",
            f"tokens-per-expert/layer-{layer}/min-to-mean")


class TokensPerExpert:
    """Counts routed tokens per (layer, expert) on this rank through forward hooks on every
    ``TopKRouter`` of ``chunks``; :meth:`reduce` gives the iteration's figures.

    Args:
        chunks: this rank's model chunks (megatron ``GPTModel``, DDP-wrapped or not).
        num_layers: transformer layers of the decoder (``model.num_layers``).
        num_experts: routed experts per MoE layer (``num_moe_experts``).
        mtp_num_layers: multi-token prediction layers after the decoder; MTP layer ``i`` counts
            as layer ``num_layers + i``, as megatron's router numbers it in its metrics.
    """

    def __init__(self, chunks, num_layers: int, num_experts: int, mtp_num_layers: int = 0):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers + mtp_num_layers, num_experts, dtype=torch.float64)
        self.handles = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    # megatron's layer_number: the global 1-based decoder layer; inside the MTP
                    # block, the layer's own number, so the MTP index comes from the name.
                    mtp = name.partition("mtp.layers.")[2]
                    row = num_layers + int(mtp.split(".")[0]) if mtp else module.layer_number - 1
                    self.handles.append(module.register_forward_hook(partial(self._hook, row)))

    def _hook(self, row: int, module, args, output) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        routing_map = output[1]
        with torch.no_grad():
            self.counts[row] += routing_map.sum(dim=0).double().cpu()

    def clear(self) -> None:
        """Forget the counts (at the start of each step)."""
        self.counts.zero_()

    def reduce(self) -> dict:
        """The iteration's figures, then the counts cleared. Collective: every rank calls it.

        Returns:
            For each layer that routed tokens, its :func:`metric_names` -> float (same on every
            rank).
        """
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        counts = self.counts.to(collective_device(group))
        torch.distributed.all_reduce(counts, group=group)
        torch.distributed.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        counts = counts.cpu()
        out = {}
        for layer, row in enumerate(counts):
            total = float(row.sum())
            if total == 0:  # a dense layer (moe_layer_freq), or nothing routed
                continue
            mean = total / row.numel()
            high, low = metric_names(layer)
            out[high], out[low] = float(row.max()) / mean, float(row.min()) / mean
        self.clear()
        return out


def attach_metrics(cfg, state, logger) -> None:
    """Add MoE figures to every logged iteration of an MoE run: the load-balancing loss
    (:func:`recipes.model.moe.reduce_aux_loss`, with an aux loss) and the per-layer tokens-per-expert
    ratios (:class:`TokensPerExpert`). Megatron's tracker and the token counts are
    cleared when a step starts (``optimizer.zero_grad``), reduced on every rank after the
    optimizer step, and merged into the metrics rank 0's ``logger`` writes (metrics.jsonl and
    wandb). Nothing happens for a dense model."""
    if not is_moe(cfg.model):
        return
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tokens = TokensPerExpert(model_chunks(state.model), int(cfg.model.num_layers),
                             int(cfg.model.num_moe_experts), mtp_num_layers(cfg.model))
    with_aux = aux_loss_name(cfg.model) is not None
    moe_layers = moe_decoder_layers(cfg.model)  # once: the table of a large model is long

    def clear():
        get_moe_metrics_tracker().clear()
        tokens.clear()

    def reduce():
        aux = (reduce_aux_loss(cfg.model, state.num_microbatches, moe_layers) if with_aux
               else {})
        return {**aux, **tokens.reduce()}

    add_to_each_step(state.optimizer, logger, clear, reduce)
