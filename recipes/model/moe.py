"""Mixture of Experts in a run: the checks before launch, the load-balancing loss metric and
the expert-GTP hooks around the model (the model itself is the MoE family's,
``recipes/families/moe/``). The token dispatchers are megatron's ``allgather`` and ``alltoall``.
``docs/moe.md`` lists the layouts and what is not done yet.
"""

from __future__ import annotations

import torch

from gtp import alignment, expert_grads
from gtp.alignment import validate_gtp_dims
from recipes.config.errors import ConfigError
from recipes.families import gtp_weight_dims, parameter_shapes
from recipes.families.moe.model import is_moe
from recipes.model.mtp import mtp_num_layers

DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# megatron's name of the aux loss in its MoE metrics tracker, and ours in metrics.jsonl/wandb.
AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def aux_loss_name(model_cfg) -> str | None:
    """The metric name of the load-balancing loss the router records (None: none)."""
    if not is_moe(model_cfg) or not model_cfg.get("moe_aux_loss_coeff"):
        return None
    return AUX_LOSS_NAMES.get(model_cfg.get("moe_router_load_balancing_type"))


def reduce_aux_loss(model_cfg, num_microbatches: int, moe_layers: int) -> dict:
    """The iteration's load-balancing loss from megatron's MoE metrics tracker
    (``moe_logging.get_moe_metrics_tracker``), then the tracker cleared. Collective: every rank
    calls it after each step.

    As megatron's ``MoEMetricsTracker.report``: per layer summed over the pipeline group and
    the entry's reduce group, averaged over its average group and the data group (gloo has no
    ``AVG`` reduction: a sum divided by the group size), times ``1 / num_microbatches``, then
    the mean over MoE layers (and the MTP layers, which megatron's ``report`` always counts).
    Megatron records the loss without ``moe_aux_loss_coeff``. ``moe_layers``: the decoder's
    MoE layers (:func:`moe_decoder_layers`, counted once per run by the caller).

    Returns:
        ``{"load_balancing_loss": float}`` (megatron's name for ``aux_loss``), empty without one.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    name = aux_loss_name(model_cfg)
    if name is None:
        return {}
    tracker = get_moe_metrics_tracker()
    # megatron's router records MTP layers after the decoder's (num_layers + mtp_num_layers).
    mtp = mtp_num_layers(model_cfg)
    tracker.ensure_initialized(name, int(model_cfg.num_layers) + mtp, device="cpu")
    entry = tracker.metrics[name]
    v = entry.values
    dist = torch.distributed

    def avg(group):
        dist.all_reduce(v, group=group)
        v.div_(dist.get_world_size(group))

    dist.all_reduce(v, group=ps.get_pipeline_model_parallel_group())
    if entry.reduce_group is not None:
        dist.all_reduce(v, group=entry.reduce_group)
    if entry.avg_group is not None:
        avg(entry.avg_group)
    if entry.needs_dp_avg:
        avg(ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False))
    # megatron's MoEMetricsTracker.report counts every MTP layer as an MoE layer.
    value = float(v.sum()) / num_microbatches / max(moe_layers + mtp, 1)
    tracker.clear()
    return {name: value}


def moe_decoder_layers(model_cfg) -> int:
    """How many decoder layers of the model are MoE layers, from its family's parameter table
    (one router each): those ``moe_layer_freq`` makes MoE, a hybrid pattern's ``E`` layers."""
    return sum(p.name.startswith("decoder.") and p.name.endswith(".mlp.router.weight")
               for p in parameter_shapes(model_cfg, 1))


def check(cfg, parallel_dims) -> None:
    """MoE and sequence-parallel rules, before any process starts (context parallelism:
    ``recipes.model.context_parallel.check``; the routing fields and ``moe_layer_freq``: the
    family's ``recipes.families.moe.checks``).

    Raises:
        ConfigError: the first problem, naming the value and what is valid.
    """
    m = cfg.model
    tp, ep = parallel_dims.tensor_model_parallel_size, parallel_dims.expert_model_parallel_size
    etp, egtp = parallel_dims.expert_tensor_parallel_size, parallel_dims.expert_gtp_remat_size
    if not is_moe(m):
        for name, value, default in (("parallelism.expert_model_parallel_size", ep, 1),
                                     ("gtp.expert_gtp_remat_size", egtp, 1)):
            if value != default:
                raise ConfigError(f"{name}={value} needs routed experts: model.{m.name} is dense "
                                  f"(model.num_moe_experts is null); set {name}={default} or "
                                  f"choose an MoE model (e.g. model=moe_tiny)")
        return
    experts = int(m.num_moe_experts)
    if experts < 1:
        raise ConfigError(f"model.num_moe_experts={experts} must be >= 1 (or null: dense)")
    if experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(f"model.num_moe_experts={experts} is not divisible by "
                          f"parallelism.expert_model_parallel_size={ep}: each EP rank holds "
                          f"num_moe_experts / ep whole experts; valid ep: {valid}")
    if not 1 <= m.moe_router_topk <= experts:
        raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must lie in [1, "
                          f"model.num_moe_experts={experts}]")
    softmax = m.get("moe_router_score_function", "softmax") == "softmax"
    if m.moe_router_topk == 1 and softmax and not m.get("moe_router_pre_softmax", False):
        # megatron's TopKRouter: a softmax over the one chosen logit is always 1.
        raise ConfigError("model.moe_router_topk=1 needs model.moe_router_pre_softmax=true "
                          "(softmax over all experts before the top-1; megatron refuses top-1 "
                          "without it), or model.moe_router_topk >= 2")
    if m.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0 "
                          f"(0: no load-balancing loss)")
    if m.moe_token_dispatcher_type not in DISPATCHERS:
        raise ConfigError(f"model.moe_token_dispatcher_type={m.moe_token_dispatcher_type!r}: valid "
                          f"are {DISPATCHERS} (megatron's 'flex' needs DeepEP or HybridEP)")
    if m.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        raise ConfigError(f"model.moe_router_load_balancing_type="
                          f"{m.moe_router_load_balancing_type!r}: valid are {LOAD_BALANCING_TYPES}")
    width = m.get("moe_ffn_hidden_size") or m.ffn_hidden_size
    if width % etp:
        raise ConfigError(f"model.moe_ffn_hidden_size={width} must be divisible by "
                          f"parallelism.expert_tensor_parallel_size={etp}")
    shared = m.get("moe_shared_expert_intermediate_size")
    if shared and shared % tp:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={shared} must be divisible "
                          f"by parallelism.tensor_model_parallel_size={tp}")
    if tp > 1 and not parallel_dims.sequence_parallel:
        # MoELayer.forward raises in training: "performance may degrade if MoE and tensor
        # parallelism are enabled without also enabling sequence parallelism".
        raise ConfigError(f"an MoE model at parallelism.tensor_model_parallel_size={tp} needs "
                          f"sequence parallelism (megatron's MoELayer refuses to train "
                          f"without it): set parallelism.sequence_parallel=true")
    if m.get("add_bias_linear", True):
        # megatron-core 0.19.2's MLP.forward adds an expert's fc2 bias in place to the output
        # of the reduce Function, which autograd refuses in the first backward (every layout:
        # the local experts are SequentialMLP's MLPs; at expert TP > 1 megatron refuses too).
        raise ConfigError("model.add_bias_linear=true with an MoE model: megatron-core 0.19.2's "
                          "experts (MLP.forward) add their fc2 bias in place to a tensor "
                          "autograd may not modify, so the first backward fails; set "
                          "model.add_bias_linear=false")
    if egtp > 1:
        _check_expert_gtp(cfg, parallel_dims)
    _check_checkpoints(cfg, parallel_dims)


def _check_checkpoints(cfg, parallel_dims) -> None:
    """What MoE checkpoints support (docs/moe.md, Checkpoints): the logical format (fp32 or
    bf16 parameters, megatron's plain or distributed optimizer) and the stock one with fp32
    parameters and the plain optimizer (read at other layouts through ckpt.stock); pretrained
    starts (a Mixtral / Qwen3-MoE import, or a checkpoint) load logical-format weights at any
    expert layout. Anything else is refused, naming why."""
    ck, m = cfg.checkpoint, cfg.model
    used = [key for key in ("save", "load") if ck.get(key) is not None]
    if not used or ck.get("format", "logical") == "logical":
        return
    why = None
    if parallel_dims.use_distributed_optimizer:
        why = ("optim.use_distributed_optimizer=true (untested with stock MoE checkpoints); "
               "set optim.use_distributed_optimizer=false or checkpoint.format=logical")
    elif cfg.precision.params_dtype != "fp32":
        why = (f"precision.params_dtype={cfg.precision.params_dtype} (untested with stock MoE "
               f"checkpoints); use precision=fp32 or checkpoint.format=logical")
    if why:
        raise ConfigError(f"checkpoint.{used[0]}={ck[used[0]]!r} with an MoE model "
                          f"(model.{m.name}), checkpoint.format={ck.format!r} and {why}, or "
                          f"train without checkpoints: checkpoint=none")


def _check_expert_gtp(cfg, parallel_dims) -> None:
    egtp = parallel_dims.expert_gtp_remat_size
    if parallel_dims.gtp_remat_size > 1 and parallel_dims.gtp_remat_size != egtp:
        raise ConfigError(f"gtp.expert_gtp_remat_size={egtp} with gtp.gtp_remat_size="
                          f"{parallel_dims.gtp_remat_size}: set them equal, or "
                          f"gtp.gtp_remat_size=1")
    tp = parallel_dims.tensor_model_parallel_size
    dims = {n: d for n, d in gtp_weight_dims(cfg, tp).items() if ".local_experts." in n}
    try:
        validate_gtp_dims(dims.values(), egtp, parallel_dims.pad_for_alignment)
    except ValueError as exc:
        raise ConfigError(f"gtp.expert_gtp_remat_size={egtp} with gtp.pad_for_alignment="
                          f"{parallel_dims.pad_for_alignment}: {exc}") from None


def after_model(chunk, parallel_dims) -> None:
    """Before DDP: expert GTP's first gradient fix (``gtp.expert_grads.tag_expert_params``) and,
    without dense GTP (``recipes.model.gtp_setup.after_model`` checks it otherwise), the expert shards'
    alignment (``gtp.alignment.check_pad_applied``)."""
    if parallel_dims.expert_gtp_remat_size <= 1:
        return
    expert_grads.tag_expert_params(chunk, parallel_dims.expert_gtp_remat_size)
    if parallel_dims.gtp_remat_size == 1:
        alignment.check_pad_applied(chunk, parallel_dims.pad_for_alignment)


def after_ddp(ddp_chunk, parallel_dims) -> None:
    """After DDP: the expert buckets' gradient scale (``gtp.expert_grads.scale_expert_gradients``),
    wherever the dense and the expert GTP sizes differ."""
    expert_grads.scale_expert_gradients(ddp_chunk, parallel_dims.expert_gtp_remat_size,
                                        parallel_dims.gtp_remat_size)
