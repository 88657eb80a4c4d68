"""The train step and loop: micro-batches, gradient sync, clipping, Adam step, lr schedule."""

from __future__ import annotations

import math
import time
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model

from gtp.collectives import collective_device
from gtp.grad_stats import grad_norms_by_part
from recipes.model import context_parallel
from recipes.run import preemption
from recipes.metrics import throughput
from ckpt.io import faults
from recipes.data import build_tokenizer
from recipes.model.build import model_chunks
from recipes.model.moe import is_moe
from recipes.model.shapes import padded_vocab_size


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """One micro-batch's loss, as Megatron-LM's ``pretrain_gpt.loss_func``.

    Without ``per_token``: the mean over its loss tokens; with context parallelism, over the
    whole sequence (:func:`recipes.model.context_parallel.loss_over_cp`). megatron's schedule divides
    it by the number of micro-batches and DDP averages over the data-parallel group, so the
    step's loss is the mean of the micro-batches' means.

    With ``per_token`` (megatron's ``calculate_per_token_loss``): the sum over this rank's loss
    tokens and their count. The schedule leaves the sum undivided and ``finalize_model_grads``
    divides every gradient by the count summed over the global batch (all micro-batches, the
    data-parallel and context-parallel ranks): the mean over the global batch's loss tokens.

    Args:
        loss_mask: float [micro_batch_size, seq_length / CP], 1 for tokens that count.
        output_tensor: float [micro_batch_size, seq_length / CP] per-token cross entropy from
            GPTModel.

    Returns:
        ``(loss, {"lm loss": loss})``, or with ``per_token`` ``(sum, count, {"lm loss":
        [sum, count]})`` (count an int tensor; :func:`_lm_loss` reduces either).
    """
    if per_token:
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        total = torch.sum(losses * mask)
        count = mask.sum()
        return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count])}
    if parallel_state.get_context_parallel_world_size() > 1:
        loss, reported = context_parallel.loss_over_cp(
            loss_mask, output_tensor, parallel_state.get_context_parallel_group())
        return loss, {"lm loss": reported}
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: megatron divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """megatron ``forward_step_func``: one micro-batch (this rank's share of its sequence with
    context parallelism) through the model; a batch with ``images`` through a vision-language
    model (``LLaVAModel``: images, then the text arguments)."""
    batch = context_parallel.batch_on_this_rank(next(data_iterator))
    device = next(model.parameters()).device
    if device.type != "cpu":
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    per_token = get_model_config(model).calculate_per_token_loss
    if "images" in batch:
        # megatron's LLaVAModel: the image's embeddings replace its token, so the loss and the
        # loss mask it returns are over that longer sequence.
        output, loss_mask = model(batch["images"], batch["tokens"], batch["position_ids"], None,
                                  labels=batch["labels"], loss_mask=batch["loss_mask"])
        return output, partial(loss_func, loss_mask, per_token=per_token)
    # loss_mask: megatron's MTP loss (multi_token_prediction.process_mtp_loss) masks with it.
    # attention_mask: packed chat samples' block-diagonal causal mask (None: causal).
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], per_token=per_token)


def _sum_over_data_group(value: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    value = value.detach().to(collective_device(group), copy=True)
    torch.distributed.all_reduce(value, group=group)
    return value


def _lm_loss(losses: list) -> float:
    """The global batch's ``lm loss``, the same on every rank.

    Only the last pipeline stage computes it (megatron's schedules return an empty list on the
    others): the mean of the micro-batches' losses averaged over the data-parallel group, or
    (per-token loss, ``[sum, count]`` per micro-batch) the summed loss over the summed count,
    as Megatron-LM's ``training.train_step`` reduces either. It is then broadcast from the last
    stage over each pipeline group, so rank 0 logs it, as Megatron-LM's last rank reports it. A
    broadcast (not a reduction) carries a NaN/inf as it is, for the non-finite check.
    """
    if losses:
        stacked = torch.stack([x["lm loss"] for x in losses])
        if stacked.dim() == 2:  # per-token: [sum, count] per micro-batch
            total = _sum_over_data_group(stacked.sum(0))
            local = total[0] / total[1].clamp(min=1)
        else:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            local = _sum_over_data_group(stacked.mean()) / torch.distributed.get_world_size(group)
    else:
        local = torch.tensor(float("nan"))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        local = local.reshape(1).float().to(collective_device(group))
        torch.distributed.broadcast(local, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=group)
    return float(local.reshape(()).item())


def _layer_offset(chunk) -> int:
    """Global index of ``chunk``'s first transformer layer (megatron's 1-based, global
    ``TransformerLayer.layer_number``); 0 for a chunk without layers."""
    layers = unwrap_model(chunk).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


class NonFiniteError(FloatingPointError):
    """A non-finite ``lm loss`` or ``grad-norm``: the step was not applied."""


def train_step(model, optimizer, scheduler, data_iterator, num_microbatches: int, cfg) -> dict:
    """One optimizer step over ``num_microbatches`` micro-batches on this rank.

    With ``train.check_for_nan_in_loss_and_grad`` (Megatron-LM's check_for_nan_in_loss_and_grad)
    the loss and the grad norm are checked before the step: a NaN/inf in either skips the update
    (weights, moments and the lr schedule stay as they were) and returns ``skipped: True``. The
    figures are the same on every rank (the loss is averaged over the data group, the norm
    reduced over the model-parallel groups), so every rank decides alike.

    Returns:
        ``lm loss`` (mean over the global batch, from the last pipeline stage), ``grad-norm``
        (before clipping, each logical element once), ``num-zeros`` (NaN when skipped),
        ``learning-rate`` (the one the step used), ``skipped`` (bool) and, with
        ``logger.grad_norm_detail``, ``grad-norm/<layer type>`` and ``grad-norm/layer-<i>``
        (:func:`gtp.grad_stats.grad_norms_by_part`).
    """
    chunks = model_chunks(model)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # pp1: no pipelining; pp > 1: 1F1B; with vpp: interleaved 1F1B (one data iterator per chunk).
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.data.micro_batch_size,
        forward_only=False,
    )
    lr = optimizer.param_groups[0]["lr"]
    detail = {}
    if cfg.logger.get("grad_norm_detail", False):
        # Before the step: it clips the gradients in place.
        detail = grad_norms_by_part([(c.named_parameters(), _layer_offset(c)) for c in chunks],
                                    cfg.model.num_layers, *_grad_stats_groups(optimizer, cfg))
    loss = _lm_loss(losses)
    if cfg.train.get("check_for_nan_in_loss_and_grad", True):
        # megatron's MegatronOptimizer.step, split so the norm is seen before any update.
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return {"lm loss": loss, "grad-norm": norm, "num-zeros": float("nan"),
                    "learning-rate": lr, "skipped": True, **detail}
    ok, grad_norm, num_zeros = optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped (inf/nan in gradients)")
    scheduler.step(increment=1)
    return {
        "lm loss": loss,
        "grad-norm": float(grad_norm),
        "num-zeros": float(num_zeros or 0),
        "learning-rate": lr,
        "skipped": False,
        **detail,
    }


def _grad_stats_groups(optimizer, cfg) -> tuple:
    """``(group, expert_group, expert_tp_group)`` of :func:`gtp.grad_stats.grad_norms_by_part`:
    the dense optimizer's gradient-statistics group and, for an MoE model, the expert one
    megatron's ``get_megatron_optimizer`` gives its expert optimizer
    (``expt_tp_pp_with_egtp_remat``) with the expert tensor-parallel group."""
    from megatron.core import parallel_state as ps

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    group = chained[0].get_grad_stats_parallel_group()
    if not is_moe(cfg.model):
        return group, None, None
    return (group, ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True),
            ps.get_expert_tensor_parallel_group())


def evaluate(model, validation, cfg) -> dict:
    """Validation loss over ``validation`` (a ``recipes.data.ValidationBatches``), forward only,
    as Megatron-LM's ``training.evaluate``: the model in eval mode, no gradients, the same loss
    as training averaged over every micro-batch of the global batches and over the data group.

    Returns:
        ``{"lm loss validation": loss, "lm loss validation ppl": exp(min(20, loss))}`` (Megatron-LM's
        names; the exponent is clamped at 20 as in its ``evaluate_and_print_results``).
    """
    chunks = model_chunks(model)
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            # One pass over the same batches per model chunk (interleaved pipeline stages).
            iterators = [iter(validation) for _ in chunks]
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks,
                num_microbatches=len(validation),
                seq_length=cfg.model.seq_length,
                micro_batch_size=cfg.data.micro_batch_size,
                forward_only=True,
            )
    finally:
        for chunk in chunks:
            chunk.train()
    loss = _lm_loss(losses)
    return {"lm loss validation": loss, "lm loss validation ppl": math.exp(min(20.0, loss))}


def eval_due(iteration: int, cfg) -> bool:
    """Validation runs every ``train.eval_interval`` iterations and at ``train.train_iters``."""
    t = cfg.train
    if not t.get("eval_iters", 0):
        return False
    return iteration == t.train_iters or bool(t.eval_interval and iteration % t.eval_interval == 0)


def _flops_per_iteration(cfg) -> float:
    """Megatron-LM's model FLOPs of one iteration (``recipes.metrics.throughput``)."""
    padded = padded_vocab_size(build_tokenizer(cfg.data).vocab_size,
                               cfg.model.make_vocab_size_divisible_by,
                               cfg.parallelism.tensor_model_parallel_size)
    return throughput.model_flops_per_iteration(cfg, padded)


def _peak_memory_over_ranks() -> int:
    """The largest peak memory of any rank, bytes (``recipes.metrics.throughput.peak_memory_bytes``)."""
    peak = torch.tensor([throughput.peak_memory_bytes()], dtype=torch.int64,
                        device=collective_device())
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return int(peak.item())


def train(state, cfg, logger, checkpoints) -> str | None:
    """Run iterations ``state.iteration + 1 .. train.train_iters``, with validation where
    :func:`eval_due` (its metrics join that iteration's row), or until
    :func:`recipes.run.preemption.exit_reason` stops the run after an iteration: then that
    iteration is saved synchronously (unless its regular save is already in flight, which is
    waited for) and the reason returned.

    Args:
        state: the worker's ``RunState`` (model, optimizer, scheduler, data iterator, counters).
        cfg: the run config.
        logger: a ``MetricLogger`` on rank 0, else None.
        checkpoints: the run's :class:`ckpt.io.manager.CheckpointManager`; its
            ``step`` runs on every rank after every iteration (finalizes a finished background
            save, saves when due), its ``stop`` when the run stops early.

    Returns:
        None at ``train.train_iters``; else what stopped the run early (``"SIGTERM"``...).

    Raises:
        NonFiniteError: a non-finite loss or grad norm (unless ``train.skip_nonfinite_iterations``),
            naming the iteration and the last good checkpoint; nothing of the step was applied.
    """
    d = cfg.data
    tokens_per_step = d.global_batch_size * cfg.model.seq_length
    flops, world = _flops_per_iteration(cfg), torch.distributed.get_world_size()
    while state.iteration < cfg.train.train_iters:
        start = time.perf_counter()
        metrics = train_step(
            state.model, state.optimizer, state.scheduler, state.data_iterator,
            state.num_microbatches, cfg,
        )
        state.iteration += 1
        state.consumed_samples += d.global_batch_size
        faults.maybe_fail("train", state.iteration, torch.distributed.get_rank())
        skipped = metrics.pop("skipped")
        state.skipped += skipped
        elapsed = time.perf_counter() - start
        metrics.update({
            "iteration-time": elapsed,
            "tokens-per-sec": tokens_per_step / elapsed,
            "throughput": throughput.tflops_per_gpu(flops, elapsed, world),
            "peak-memory-bytes": _peak_memory_over_ranks(),
            "consumed-samples": state.consumed_samples,
            "skipped-iterations": state.skipped,
        })
        stop = skipped and not cfg.train.get("skip_nonfinite_iterations", False)
        validated = not stop and state.validation is not None and eval_due(state.iteration, cfg)
        if validated:
            metrics.update(evaluate(state.model, state.validation, cfg))
        if logger is not None and (stop or validated or state.iteration % cfg.train.log_interval == 0):
            logger.log(state.iteration, metrics)
        if stop:
            checkpoints.wait()  # every rank stops here: a save in flight still completes
            last = checkpoints.last_good
            raise NonFiniteError(
                f"iteration {state.iteration}: lm loss {metrics['lm loss']}, grad-norm "
                f"{metrics['grad-norm']}: not finite; the step was not applied and the run stops. "
                f"Last good checkpoint: {last if last else 'none (no save yet)'} "
                f"(train.skip_nonfinite_iterations=true skips such steps instead)")
        checkpoints.step(state, cfg.train.train_iters, logger)
        reason = preemption.exit_reason(state.iteration, cfg.train)
        if reason is not None:
            checkpoints.stop(state, logger)
            return reason
    return None
