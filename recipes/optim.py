"""Megatron's optimizer (Adam, fp32 main params) and its lr scheduler from the config."""

from __future__ import annotations

# lr decay styles of megatron's OptimizerParamScheduler that ``optim.lr_decay_style`` may take.
LR_DECAY_STYLES = ("cosine", "linear", "constant")


def build_optimizer(cfg, ddp_chunks):
    """Adam through megatron's ``get_megatron_optimizer`` (fp32 grads), megatron's
    ``DistributedOptimizer`` when ``optim.use_distributed_optimizer`` (Adam state and fp32 main
    params sharded over the data-parallel group; the DDP chunks must have been built with
    ``use_distributed_optimizer=True``).

    Args:
        cfg: the run config.
        ddp_chunks: the DDP-wrapped model chunks of this rank (a list; one without vpp).

    Returns a ``MegatronOptimizer`` whose ``step()`` returns ``(success, grad_norm, num_zeros)``
    with the grad norm counted over each logical element once (megatron filters TP and GTP
    duplicates and the pipeline copy of a tied embedding in
    ``MegatronOptimizer.get_main_grads_for_grad_norm``, and reduces over the model-parallel
    group, plus the data-parallel group with the distributed optimizer).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optim
    bf16 = cfg.precision.params_dtype == "bf16"
    config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=bf16,
        params_dtype=ddp_chunks[0].config.params_dtype,
        use_distributed_optimizer=bool(o.get("use_distributed_optimizer", False)),
        log_num_zeros_in_grad=True,
    )
    return get_megatron_optimizer(config, list(ddp_chunks))


def build_scheduler(cfg, optimizer):
    """megatron's ``OptimizerParamScheduler``: linear warmup over ``lr_warmup_iters`` then
    ``lr_decay_style`` decay to ``min_lr`` at ``lr_decay_iters`` (default ``train_iters``).

    Units are iterations (``step(1)`` once per optimizer step), as in Megatron-LM with
    ``--lr-warmup-iters``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, t = cfg.optim, cfg.train
    decay = o.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        # On resume: the checkpoint's schedule, or this config's with the override switch.
        override_opt_param_scheduler=bool(o.get("override_opt_param_scheduler", False)),
        use_checkpoint_opt_param_scheduler=not o.get("override_opt_param_scheduler", False),
    )


def apply_schedule_override(optimizer, scheduler, cfg) -> None:
    """Set the param groups' lr and weight-decay bounds to ``cfg.optim``'s after a load.

    megatron identifies param groups on load by keys that include ``max_lr``/``min_lr``/
    ``start_wd``/``end_wd`` (``param_group_identifier_keys``), so the optimizer is built and
    loaded with the checkpoint's values; with ``optim.override_opt_param_scheduler`` this then
    moves the groups to the new ones, which megatron's scheduler reads in ``get_lr``/``get_wd``,
    and writes ``optim.adam_beta1``/``adam_beta2``/``adam_eps`` into every group's ``betas`` and
    ``eps`` (torch's ``Optimizer.load_state_dict`` restores the checkpoint's).
    """
    o = cfg.optim
    values = {"max_lr": o.lr, "min_lr": o.min_lr, "start_wd": o.weight_decay, "end_wd": o.weight_decay,
              # torch's load_state_dict restored the checkpoint's Adam hyper-parameters.
              "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps}
    for group in optimizer.param_groups:
        for key, value in values.items():
            if key in group:
                group[key] = value
    # The scheduler's load set each group's lr and weight decay from the old bounds; the next
    # iteration must already run on the new ones (step(0): same iteration, recomputed).
    scheduler.step(0)
