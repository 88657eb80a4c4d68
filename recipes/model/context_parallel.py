"""Context parallelism (``parallelism.context_parallel_size``, CP): each micro-batch's sequence is
split over the CP ranks of a data-parallel replica, as Megatron-LM's ``pretrain_gpt`` does.

* Before launch (:func:`check`): refused without TransformerEngine (megatron-core 0.19.2's local
  ``DotProductAttention`` asserts ``context_parallel_size == 1``; only TransformerEngine's
  ``TEDotProductAttention`` has CP), and ``model.seq_length`` must split into ``2 x CP`` chunks.
* The batch (:func:`batch_on_this_rank`): megatron's
  ``megatron.core.utils.get_batch_on_this_cp_rank`` (per-sequence zigzag: ``2 x CP`` chunks,
  rank ``r`` keeps chunks ``r`` and ``2 CP - 1 - r``, so every rank gets the same
  causal-attention work). The CP ranks of one replica read the same micro-batches (the data
  group is megatron's data-parallel group without CP).
* The loss (:func:`loss_over_cp`): Megatron-LM ``pretrain_gpt.loss_func`` with
  ``context_parallel_size``: loss sums and token counts all-reduced over the CP group.
"""

from __future__ import annotations

from recipes.model import te
from recipes.config.errors import ConfigError


def check(cfg, parallel_dims) -> None:
    """The context-parallel rules, before any process starts (nothing at CP 1).

    Raises:
        ConfigError: CP > 1 without TransformerEngine (naming ``TEDotProductAttention``), or
            ``model.seq_length`` not divisible by ``2 x context_parallel_size``.
    """
    cp = parallel_dims.context_parallel_size
    if cp == 1:
        return
    if not te.uses_transformer_engine(cfg):
        raise ConfigError(
            f"parallelism.context_parallel_size={cp} needs TransformerEngine (not importable "
            f"here, or model.transformer_impl=local): megatron-core 0.19.2's local attention "
            f"(DotProductAttention) asserts context_parallel_size == 1, context parallelism exists only in "
            f"TransformerEngine's TEDotProductAttention; set parallelism.context_parallel_size=1")
    s = cfg.model.seq_length
    if s % (2 * cp):
        valid = [c for c in (1, 2, 4, 8, 16, 32) if s % (2 * c) == 0]
        raise ConfigError(
            f"model.seq_length={s} is not divisible by 2 x parallelism.context_parallel_size="
            f"{2 * cp}: megatron's get_batch_on_this_cp_rank splits each sequence into 2 x CP "
            f"equal chunks; for this length context_parallel_size may be one of {valid} (or "
            f"another size whose double divides {s})")


def batch_on_this_rank(batch: dict, cp_group=None) -> dict:
    """This CP rank's share of a micro-batch (unchanged at CP 1).

    Args:
        batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of shape
            [micro_batch_size, seq_length] (any dtype; an ``attention_mask`` is split along dim 2).
        cp_group: the CP process group (default: megatron's ``get_context_parallel_group()``).

    Returns:
        A new dict with each tensor of shape [micro_batch_size, seq_length / CP]: the
        concatenation of chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP`` equal chunks, ``r`` this
        rank's CP rank (megatron's ``megatron.core.utils.get_batch_on_this_cp_rank``).

    Raises:
        RuntimeError: (from megatron's view) a sequence length not divisible by ``2 x CP``
            (:func:`check` refuses it before launch).
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cp_group is None:
        if parallel_state.get_context_parallel_world_size() == 1:
            return batch
        cp_group = parallel_state.get_context_parallel_group()
    # is_hybrid_cp=False and no cu_seqlens: megatron's per-sequence zigzag split.
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


def loss_over_cp(loss_mask, output_tensor, cp_group):
    """The loss of one micro-batch whose sequence is split over the CP group, as Megatron-LM's
    ``pretrain_gpt.loss_func`` with ``context_parallel_size > 1``: the masked loss sum and the
    token count are all-reduced over the CP group.

    Args:
        loss_mask: float [micro_batch_size, seq_length / CP], this rank's chunks.
        output_tensor: float [micro_batch_size, seq_length / CP] per-token cross entropy.
        cp_group: the CP process group.

    Returns:
        ``(loss, reported)``: ``loss`` = this rank's loss sum / the whole sequence's token count
        (differentiable; megatron 0.19.2's ``schedules.forward_step_calc_loss`` multiplies a
        two-value ``loss_func`` result by the CP size and DDP averages gradients over data x CP,
        so the gradient is the whole sequence's mean loss's); ``reported`` = the whole
        sequence's mean token loss (detached, the same on every CP rank).
    """
    import torch  # not at the top: recipes.config.validate imports this module before launch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    local = torch.stack([torch.sum(losses * mask), mask.sum()])
    total = local.detach().clone()
    torch.distributed.all_reduce(total, group=cp_group)
    return local[0] / total[1], total[0] / total[1]
