"""Megatron's optimizer (Adam or Muon, fp32 main params) and its lr scheduler from the config."""

from __future__ import annotations

from typing import Optional

from recipes.config.errors import ConfigError

# lr decay styles of megatron's OptimizerParamScheduler that ``optim.lr_decay_style`` may take.
LR_DECAY_STYLES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adam", "muon")
# megatron's OptimizerConfig fields of Muon that the config carries (docs/muon.md).
MUON_FIELDS = ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_scale_mode",
               "muon_fp32_matmul_prec", "muon_coefficient_type", "muon_num_ns_steps",
               "muon_tp_mode", "muon_extra_scale_factor")
MUON_TP_MODES = ("duplicated", "blockwise", "distributed")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECISIONS = ("highest", "high", "medium")


def optim_refusal(o, params_dtype: str = "bf16", num_moe_experts: int | None = None) -> str | None:
    """Why the ``optim`` group cannot run (a message naming the value and what is valid), or
    None. ``params_dtype`` (``precision.params_dtype``) and ``num_moe_experts``
    (``model.num_moe_experts``) bound Muon's layer-wise distributed optimizer."""
    if o.optimizer not in OPTIMIZERS:
        return f"optim.optimizer={o.optimizer!r}: valid are {OPTIMIZERS}"
    if o.optimizer != "muon":
        return None
    if layer_wise(o) and params_dtype != "bf16":
        # LayerWiseDistributedOptimizer.__init__ wraps its torch optimizers in megatron's
        # Float16OptimizerWithFloat16Params only under bf16; otherwise ChainedOptimizer fails.
        return (f"optim.optimizer=muon with optim.use_distributed_optimizer=true needs "
                f"precision=bf16 (precision.params_dtype={params_dtype!r}: megatron-core "
                f"0.19.2's LayerWiseDistributedOptimizer builds no fp32 optimizer); set "
                f"precision=bf16 or optim.use_distributed_optimizer=false")
    if layer_wise(o) and num_moe_experts:
        # megatron-core 0.19.2 asserts at start-up: its layer-wise optimizer has no expert buffers.
        return (f"optim.optimizer=muon with optim.use_distributed_optimizer=true and an MoE "
                f"model (model.num_moe_experts={num_moe_experts}) is not supported by "
                f"megatron-core 0.19.2's LayerWiseDistributedOptimizer; set "
                f"optim.use_distributed_optimizer=false")
    for name, valid in (("muon_tp_mode", MUON_TP_MODES), ("muon_scale_mode", MUON_SCALE_MODES),
                        ("muon_fp32_matmul_prec", MUON_MATMUL_PRECISIONS)):
        if o[name] not in valid:
            return f"optim.{name}={o[name]!r}: valid are {valid}"
    if o.muon_num_ns_steps < 1:
        return f"optim.muon_num_ns_steps={o.muon_num_ns_steps} must be >= 1"
    if not 0 <= o.muon_momentum < 1:
        return f"optim.muon_momentum={o.muon_momentum} must lie in [0, 1)"
    from megatron.core.optimizer import emerging_optimizers

    if not emerging_optimizers.HAVE_EMERGING_OPTIMIZERS:
        return ("optim.optimizer=muon needs the emerging-optimizers and absl-py packages "
                "(`make setup` installs them)")
    valid = emerging_optimizers.get_supported_coefficient_types()
    if o.muon_coefficient_type not in valid:
        return f"optim.muon_coefficient_type={o.muon_coefficient_type!r}: valid are {valid}"
    return None


def build_optimizer(cfg, ddp_chunks):
    """Adam or Muon through megatron's ``get_megatron_optimizer`` (fp32 grads), megatron's
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

    ``optim.optimizer=muon``: megatron's ``ChainedOptimizer`` of ``TensorParallelMuon`` for 2-D
    weights and Adam for embeddings, output layer, norms and biases
    (``emerging_optimizers._is_nonlinear_or_embedding``), with :mod:`gtp.muon`'s fixes installed.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optim
    bf16 = cfg.precision.params_dtype == "bf16"
    if o.optimizer == "muon":
        from gtp import muon

        muon.install()
        muon.tag_qkv(ddp_chunks)
    config = OptimizerConfig(
        optimizer=o.optimizer,
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
        use_layer_wise_distributed_optimizer=layer_wise(o),
        log_num_zeros_in_grad=True,
        **muon_fields(o),
    )
    return get_megatron_optimizer(config, list(ddp_chunks))


def layer_wise(o) -> bool:
    """Whether ``optim`` builds megatron's ``LayerWiseDistributedOptimizer`` (Muon with
    ``optim.use_distributed_optimizer``: whole 2-D weights assigned to data-parallel ranks, the
    rest in a ``DistributedOptimizer``)."""
    return o.optimizer == "muon" and bool(o.get("use_distributed_optimizer", False))


def layer_wise_param_layouts(cfg, chunks, ddp_config) -> list | None:
    """The ``full_param_layout`` of each model chunk (not yet DDP-wrapped) for megatron's
    layer-wise distributed optimizer, or None when :func:`layer_wise` is false.

    As megatron-core 0.19.2's ``megatron.training.training.wrap_model_chunks_with_ddp`` with
    ``use_layer_wise_param_layout``: params tagged by ``tag_params_for_buffer_routing`` (2-D
    non-embedding weights into shard-aligned buffers, the rest into byte-sharded ones) and
    ``LayerWiseDistributedOptimizer.compute_full_param_layout`` over the data-parallel group
    (only the first chunk bucketed, as the DDP wrapping here).
    """
    if not layer_wise(cfg.optim):
        return None
    from megatron.core import parallel_state
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer, tag_params_for_buffer_routing)

    tag_params_for_buffer_routing(chunks)
    # The group DDP reduces gradients over (without the GTP axis: GTP peers hold distinct
    # shards of the sharded weights and reduce the replicated ones apart).
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True,
                                                     with_gtp_remat=False)
    expert_dp = parallel_state.get_expert_data_parallel_world_size()
    return [LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in chunk.parameters() if p.requires_grad],
        ddp_config.bucket_size if i == 0 else None, dp, ddp_config,
        expert_data_parallel_world_size=expert_dp) for i, chunk in enumerate(chunks)]


def muon_fields(o) -> dict:
    """``OptimizerConfig`` keyword arguments of ``optim.optimizer=muon`` (the
    :data:`MUON_FIELDS`); ``{}`` for Adam."""
    if o.optimizer != "muon":
        return {}
    return {name: o[name] for name in MUON_FIELDS}


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
              "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps,
              # Muon's groups (TensorParallelMuon) hold its momentum.
              "momentum": o.get("muon_momentum", 0.95)}
    for group in optimizer.param_groups:
        for key, value in values.items():
            if key in group:
                group[key] = value
    # The scheduler's load set each group's lr and weight decay from the old bounds; the next
    # iteration must already run on the new ones (step(0): same iteration, recomputed).
    scheduler.step(0)


# megatron-core 0.19.2 DistributedOptimizer checkpoint formats (metadata
# "distrib_optim_sharding_type") and whether a checkpoint in it loads at another layout.
DISTRIB_OPTIM_FORMATS = {
    "fully_sharded_model_space": "each DP rank's own range as model-space pieces, any layout "
                                 "(mcore_compat.fs_model_space; and the non-distributed optimizer)",
    "fully_reshardable": "whole model-space tensors gathered to every DP rank at a save, any "
                         "layout (and the non-distributed optimizer)",
    "dp_reshardable": "flat bucket buffers: reshards over DP only",
    "dp_zero_gather_scatter": "deprecated: one object per TP x PP rank",
    "fully_sharded_bucket_space": "deprecated bucket buffers",
    "fsdp_dtensor": "Megatron-FSDP only",
}
RESHARDABLE_DISTRIB_OPTIM_FORMATS = ("fully_sharded_model_space", "fully_reshardable")


def distributed_optimizer(cfg) -> tuple[bool, Optional[str]]:
    """``(use_distributed_optimizer, its checkpoint format or None)``.

    Raises:
        ConfigError: a format that cannot change layout, or an unknown one.
    """
    o = cfg.optim
    if not o.get("use_distributed_optimizer", False):
        return False, None
    if cfg.logger.get("grad_norm_detail", False):
        # After the reduce-scatter each DP rank holds only its slice of the reduced gradients.
        raise ConfigError(
            "logger.grad_norm_detail=true needs the full reduced gradients on every rank, which "
            "optim.use_distributed_optimizer=true does not keep; set one of them to false"
        )
    fmt = o.get("distrib_optim_sharding_type", RESHARDABLE_DISTRIB_OPTIM_FORMATS[0])
    if fmt not in RESHARDABLE_DISTRIB_OPTIM_FORMATS:
        why = DISTRIB_OPTIM_FORMATS.get(fmt, "not a megatron-core 0.19.2 format")
        raise ConfigError(
            f"optim.distrib_optim_sharding_type={fmt!r} ({why}) cannot be resumed at another "
            f"parallel layout; use {RESHARDABLE_DISTRIB_OPTIM_FORMATS[0]!r} (each data-parallel "
            f"rank writes its own range) or {RESHARDABLE_DISTRIB_OPTIM_FORMATS[1]!r}"
        )
    return True, fmt
