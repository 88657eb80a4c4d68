"""The dry run's printed report: what a rank holds (:mod:`recipes.dry_run.sizes`), what the
estimate assumed, and whether it fits ``train.gpu_memory_gib`` or what would make it fit."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf, open_dict

from recipes.data import build_tokenizer, check_data_paths
from recipes.dry_run.host import host_lines
from recipes.dry_run.sizes import PARAM_BYTES, RankSizes, rank_sizes, target_attention
from recipes.metrics.logger import format_bytes
from recipes.model.build import transformer_config
from recipes.model.mtp import mtp_num_layers
from recipes.model.shapes import padded_vocab_size


def _variant(cfg, parallel_dims, **changes):
    """``(cfg, layout)`` with dotted-key ``changes`` applied to copies."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(cfg):
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value)
    if "optim.use_distributed_optimizer" in changes:
        parallel_dims = dataclasses.replace(
            parallel_dims, use_distributed_optimizer=changes["optim.use_distributed_optimizer"],
            distrib_optim_sharding_type="fully_sharded_model_space")
    return cfg, parallel_dims


def fit_line(cfg, parallel_dims, vocab_size: int, sizes: RankSizes) -> str:
    """Whether ``sizes.total_bytes`` fits ``train.gpu_memory_gib``; if not, the first of the
    distributed optimizer (dp > 1), selective then full recompute and micro_batch_size 1, taken
    in that order and cumulatively, that makes it fit."""
    limit = float(cfg.train.get("gpu_memory_gib", 80.0))
    budget = limit * 2**30
    head = f"> fit: {format_bytes(sizes.total_bytes)} per rank"
    if sizes.total_bytes <= budget:
        return f"{head} fits train.gpu_memory_gib={limit:g}"
    steps = []
    if not parallel_dims.use_distributed_optimizer and \
            parallel_dims.data_parallel_size * parallel_dims.context_parallel_size > 1:
        steps.append(("optim.use_distributed_optimizer", True))
    rc = cfg.model.get("recompute_granularity")
    if rc is None:
        steps.append(("model.recompute_granularity", "selective"))
    if rc != "full":
        steps.append(("model.recompute_granularity", "full"))
    if cfg.data.micro_batch_size > 1:
        steps.append(("data.micro_batch_size", 1))
    changes: dict = {}
    for key, value in steps:
        changes[key] = value
        vcfg, vlayout = _variant(cfg, parallel_dims, **changes)
        total = rank_sizes(vcfg, vlayout, vocab_size).total_bytes
        if total <= budget:
            sets = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                            for k, v in changes.items())
            return (f"{head} does not fit train.gpu_memory_gib={limit:g}; fits with {sets} "
                    f"({format_bytes(total)})")
    return (f"{head} does not fit train.gpu_memory_gib={limit:g}, nor with the distributed "
            f"optimizer, full recompute and micro-batch 1: raise "
            f"parallelism.tensor_model_parallel_size, pipeline_model_parallel_size"
            f"{', expert_model_parallel_size' if sizes.expert_parameters else ''} or "
            f"gtp.gtp_remat_size")


def assumed_line(cfg, parallel_dims) -> str:
    """What the estimate assumed: the attention kind and where it came from
    (:func:`target_attention`), recompute, the distributed optimizer and the GPU memory."""
    kind, source = target_attention(cfg)
    scores = "no scores stored" if kind == "fused" else "scores stored"
    dp = parallel_dims.data_parallel_size * parallel_dims.context_parallel_size
    optim = (f"distributed optimizer over dp {dp}" if parallel_dims.use_distributed_optimizer
             else "no distributed optimizer")
    return (f"> assumed: attention {kind} ({scores}), {source}; recompute "
            f"{cfg.model.get('recompute_granularity') or 'none'} (model.recompute_granularity); "
            f"{optim} (optim.use_distributed_optimizer); checked against "
            f"train.gpu_memory_gib={float(cfg.train.get('gpu_memory_gib', 80.0)):g}")


def report(cfg, parallel_dims) -> str:
    """The dry-run text for ``cfg`` at ``parallel_dims`` (validated already).

    Raises:
        ValueError: megatron's ``TransformerConfig`` refuses the model config (its message).
    """
    transformer_config(cfg, parallel_dims)  # megatron's own checks of the model fields
    vocab = build_tokenizer(cfg.data).vocab_size
    tp = parallel_dims.tensor_model_parallel_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp)
    sp_text = ("sequence parallel" if parallel_dims.sequence_parallel and tp > 1
               else "no sequence parallelism")
    cp = parallel_dims.context_parallel_size
    if cp > 1:
        sp_text += (f", context parallel: {cfg.model.seq_length // cp} tokens of each sequence "
                    "per rank")
    s = rank_sizes(cfg, parallel_dims, vocab)
    dtype = cfg.precision.params_dtype
    per_param = (s.param_bytes + s.grad_bytes + s.optimizer_bytes) / max(s.parameters, 1)
    sharded = (f", 1/{parallel_dims.data_parallel_size * cp} per rank: distributed optimizer"
               if parallel_dims.use_distributed_optimizer else "")
    if sharded and s.expert_parameters:
        sharded += (f"; routed experts 1/{parallel_dims.expert_data_parallel_size}: "
                    "expert data parallel")
    rc = cfg.model.get("recompute_granularity")
    kind = target_attention(cfg)[0]
    stage = (" (most loaded pipeline stage)" if parallel_dims.pipeline_model_parallel_size > 1
             else "")
    lines = [
        "> dry run: config valid; nothing built, no process started",
        f"> layout: {parallel_dims.describe()}",
        f"> model: {cfg.model.name}, {s.total_parameters:,} parameters "
        f"(vocabulary {vocab:,} tokens, {padded:,} rows padded{_mtp_note(cfg.model)})",
        f"> per rank{stage}: {s.parameters:,} parameters, {per_param:.4g} bytes each for "
        f"weights, gradients and optimizer state",
        f">   parameters       {format_bytes(s.param_bytes)} ({dtype})",
        f">   gradients        {format_bytes(s.grad_bytes)} (fp32 grad buffer)",
        f">   optimizer state  {format_bytes(s.optimizer_bytes)} (Adam moments fp32"
        f"{', fp32 main params' if dtype != 'fp32' else ''}{sharded})",
        f">   activations      {format_bytes(s.activation_bytes)} (micro-batch "
        f"{cfg.data.micro_batch_size} x {cfg.model.seq_length} tokens, recompute "
        f"{rc or 'none'}{', attention scores stored' if kind == 'local' and not rc else ''};"
        f" Megatron-LM's formula, {sp_text})",
        f">   total            {format_bytes(s.total_bytes)}",
        assumed_line(cfg, parallel_dims),
        fit_line(cfg, parallel_dims, vocab, s),
        *host_lines(cfg, parallel_dims, padded),
    ]
    try:
        check_data_paths(cfg.data)
    except (ValueError, FileNotFoundError) as exc:
        lines.append(f"> data not checked: {exc} (a real run refuses this before launch)")
    if cfg.model.get("num_moe_experts"):
        lines.insert(3, f"> MoE: {s.active_parameters:,} active parameters per token "
                        f"(top-{cfg.model.moe_router_topk} of {cfg.model.num_moe_experts} "
                        f"experts); "
                        f"per rank {s.expert_parameters:,} routed-expert parameters, "
                        f"{format_bytes(s.expert_parameters * PARAM_BYTES[dtype])} ({dtype})")
    if parallel_dims.gtp_remat_size > 1:
        lines.append(
            f"> GTP: gtp_remat_size={parallel_dims.gtp_remat_size}, pad_for_alignment="
            f"{parallel_dims.pad_for_alignment}: {s.gtp_padding_rows:,} padding rows in the "
            f"TP-local GTP weights (a tail suffix, held by the last GTP ranks)")
    return "\n".join(lines)



def _mtp_note(m) -> str:
    """The model line's note of multi-token prediction layers (counted in its parameters; on
    the last pipeline stage, with a copy of the word embedding there under pipeline
    parallelism)."""
    n = mtp_num_layers(m)
    return f"; {n} MTP layer{'s' if n > 1 else ''} included" if n else ""
