"""``train.dry_run=true``: check a whole config for its world size and say what each rank holds.

Nothing heavy is built and no process starts: the config is validated (``recipes.prelaunch``),
megatron's ``TransformerConfig`` is constructed (its own checks run), and the sizes come from
``recipes.shapes``. Per rank of the most loaded pipeline stage, with megatron's DDP (fp32
gradient buffer, ``grad_reduce_in_fp32``) and Adam, as Megatron-LM's
``theoretical_memory_usage.compute_weight_and_optimizer_memory`` counts them:

* parameters: ``params_dtype`` bytes each (GTP padding rows included: they are allocated);
* gradients: 4 bytes each (fp32 ``main_grad`` buffer);
* optimizer state: ``exp_avg`` and ``exp_avg_sq`` in fp32 (8 bytes), plus an fp32 main copy of
  each parameter (4 bytes) when parameters are bf16; with the distributed optimizer
  (``optim.use_distributed_optimizer``) each data-parallel rank holds 1/dp of it. So bf16:
  18 bytes per parameter without it, 6 + 12 / dp with it.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) as Megatron-LM's ``compute_activation_memory`` applies it, with
or without sequence parallelism; see :func:`activation_bytes`. Temporary
buffers (all-gathers, the loss's logits copies) are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

_BYTES = {"fp32": 4, "bf16": 2}
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class RankSizes:
    """What one rank of the most loaded pipeline stage holds (bytes unless named otherwise)."""

    total_parameters: int  # the whole model, padded vocabulary, no GTP padding
    parameters: int  # on one rank, GTP padding rows included
    gtp_padding_rows: int  # padding rows added to the TP-local GTP weights (shared by g ranks)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int = 0
    active_parameters: int = 0  # per token: routed experts count topk / num_moe_experts
    expert_parameters: int = 0  # routed-expert parameters on one rank (of ``parameters``)

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients, optimizer state and activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def _stage(name: str, num_layers: int, pp: int) -> tuple[int, ...]:
    """Pipeline stages holding parameter ``name`` (megatron: the embedding on the first stage,
    final norm and output layer on the last, layers split evenly; a shared output weight is a
    copy of the embedding on the last stage)."""
    if name.startswith("embedding."):
        return (0,)
    if name.startswith("decoder.layers."):
        return (int(name.split(".")[2]) * pp // num_layers,)
    return (pp - 1,)


def rank_sizes(cfg, layout, vocab_size: int) -> RankSizes:
    """Per-rank parameter count and bytes of ``cfg`` at ``layout`` for a ``vocab_size``-token
    tokenizer (padded as ``recipes.shapes.padded_vocab_size``), on the pipeline stage holding the
    most parameters, activations included (:func:`activation_bytes`).

    Optimizer bytes with the distributed optimizer: ``ceil(dense parameters * (8 + main copy) /
    (dp x cp)) + ceil(routed-expert parameters * (8 + main copy) / expert dp)`` (megatron-core's
    ``optimizer.get_megatron_optimizer`` shards the dense state over the data-parallel group
    with context parallelism, the experts' over the expert data-parallel group).
    """
    from recipes.shapes import padded_vocab_size
    from recipes.families import parameter_shapes
    from recipes.shapes import local_shape

    tp, g, pad = layout.tensor_model_parallel_size, layout.gtp_remat_size, layout.pad_for_alignment
    pp, m = layout.pipeline_model_parallel_size, cfg.model
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    shapes = parameter_shapes(m, padded)
    per_stage, pad_rows, total = [0] * pp, [0] * pp, 0
    experts_per_stage = [0] * pp
    ep, etp, egtp = (layout.expert_model_parallel_size, layout.expert_tensor_parallel_size,
                     layout.expert_gtp_remat_size)
    local_experts = (m.num_moe_experts // ep) if m.get("num_moe_experts") else 0
    for p in shapes:
        if p.expert:  # an EP rank holds num_moe_experts / ep experts, split by etp x egtp
            if int(p.name.split(".local_experts.")[1].split(".")[0]) >= local_experts:
                total += math.prod(p.shape)
                continue
            shape, pad_length = local_shape(p, etp, egtp, pad)
        else:
            shape, pad_length = local_shape(p, tp, g, pad)
        total += math.prod(p.shape)
        stages = _stage(p.name, m.num_layers, pp)
        if p.name == "embedding.word_embeddings.weight" and m.share_embeddings_and_output_weights \
                and pp > 1:
            stages = (0, pp - 1)
        for s in stages:
            per_stage[s] += math.prod(shape)
            pad_rows[s] += pad_length
            if p.expert:
                experts_per_stage[s] += math.prod(shape)
    stage = max(range(pp), key=lambda s: per_stage[s])
    local = per_stage[stage]
    dtype = cfg.precision.params_dtype
    state = 8 + (4 if dtype != "fp32" else 0)
    dp, edp = ((layout.data_parallel_size * layout.context_parallel_size,
                layout.expert_data_parallel_size) if layout.use_distributed_optimizer else (1, 1))
    experts = experts_per_stage[stage]
    from recipes.families import parameter_counts

    return RankSizes(
        active_parameters=parameter_counts(m, padded)[1],
        expert_parameters=experts_per_stage[stage],
        total_parameters=total, parameters=local, gtp_padding_rows=pad_rows[stage],
        param_bytes=local * _BYTES[dtype], grad_bytes=local * 4,
        optimizer_bytes=-(-(local - experts) * state // dp) - (-experts * state // edp),
        activation_bytes=activation_bytes(cfg, layout, padded),
    )


IMPLS = ("transformer_engine", "local")


def target_attention(cfg) -> tuple[str, str]:
    """``(kind, source)`` of the attention the estimate assumes: kind ``"fused"``
    (TransformerEngine's fused/flash attention keeps no scores) or ``"local"`` (megatron's
    ``DotProductAttention`` keeps its ``a x s x s`` scores for the backward); source names
    where that came from: ``model.transformer_impl`` (the machine the recipe targets) or, when
    it is null, whether TransformerEngine imports on this machine.

    Raises:
        ValueError: ``model.transformer_impl`` is not null, "transformer_engine" or "local".
    """
    impl = cfg.model.get("transformer_impl")
    if impl is None:
        from recipes import te

        usable = te.transformer_engine_usable()
        return (("fused" if usable else "local"),
                f"this machine: TransformerEngine {'imports' if usable else 'not importable'}, "
                f"model.transformer_impl=null")
    if impl not in IMPLS:
        raise ValueError(f"model.transformer_impl={impl!r}: valid are null, {', '.join(IMPLS)}")
    return ("fused" if impl == "transformer_engine" else "local"),\
        f"from model.transformer_impl={impl}"


def attention_scores_stored(cfg) -> bool:
    """Whether attention keeps its ``a x s x s`` scores for the backward (:func:`target_attention`
    is local): megatron's local ``DotProductAttention`` does, fused attention does not."""
    return target_attention(cfg)[0] == "local"


def activation_bytes(cfg, layout, padded_vocab: int, scores: bool | None = None) -> int:
    """Activation bytes on a rank of the first pipeline stage (the most in flight).

    Per layer, with ``s`` = seq_length, ``b`` = micro_batch_size, ``h`` = hidden_size, ``a`` =
    heads, ``f`` = ffn_hidden_size, ``t`` = tp (Korthikanti et al. 2022 Table 2, the 24
    generalized to ``8 + 4 f / h`` as Megatron-LM's ``compute_activation_memory``):

    * no recompute: ``s b h (10 + (8 + 4 f / h) / t) + 5 a s^2 b / t`` (the last term only when
      the attention scores are stored, ``scores``; default :func:`attention_scores_stored`);
      with ``parallelism.sequence_parallel`` (t > 1) the norms' and dropouts' ``10`` is split
      too: ``s b h (10 + 8 + 4 f / h) / t``;
    * ``model.recompute_granularity=selective``: the same without the ``5 a s^2 b / t`` term;
    * ``full``: ``2 s b h`` (each layer's input; ``/ t`` with sequence parallelism).

    Times ``num_layers`` (pp stages of num_layers / pp layers, pp micro-batches in flight on the
    first), plus the embedding's ``8 s b pp + s b h pp``; then Megatron-LM's pipeline factors
    (interleaved: ``1 + (pp - 1) / (pp vpp)``; 1F1B: ``min(1, micro-batches / pp)``) and, at
    pp 1, the output layer and loss ``4 s b h + 4 s b v / t``; with sequence parallelism the
    embedding's and output layer's ``s b h`` terms are divided by t. With context parallelism
    each rank holds ``s / cp`` of every sequence: the whole is divided by cp (the ``s^2`` term
    too: each rank's queries against every key). Megatron's constants count 16-bit
    activations; fp32 parameters (fp32 activations) double the figure.
    """
    m, d = cfg.model, cfg.data
    s, b, h, a = m.seq_length, d.micro_batch_size, m.hidden_size, m.num_attention_heads
    f, L = m.ffn_hidden_size, m.num_layers
    t, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    vpp = layout.virtual_pipeline_model_parallel_size
    recompute = m.get("recompute_granularity")
    scores = attention_scores_stored(cfg) if scores is None else scores
    sp = t if layout.sequence_parallel and t > 1 else 1  # the sequence split over tp ranks
    if recompute == "full":
        layer = 2 * s * b * h / sp
    else:
        layer = s * b * h * (10 / sp + (8 + 4 * f / h) / t)
        if recompute is None and scores:
            layer += 5 * a * s * s * b / t
    act = layer * L + (8 * s * b * pp + s * b * h * pp) / sp
    if vpp:
        act *= 1 + (pp - 1) / (pp * vpp)
    elif pp > 1:
        data_group = layout.data_parallel_size * layout.gtp_remat_size
        micro_batches = d.global_batch_size // (d.micro_batch_size * data_group)
        act *= min(1, micro_batches / pp)
    if pp == 1:
        act += 4 * s * b * h / sp + 4 * s * b * padded_vocab / t
    act /= layout.context_parallel_size
    if cfg.precision.params_dtype == "fp32":
        act *= 2
    return int(math.ceil(act))


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB, TiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while i < len(units) - 1 and abs(n) >= 1024:
        n /= 1024
        i += 1
    return f"{int(n)} B" if i == 0 else f"{n:.2f} {units[i]}"


def _variant(cfg, layout, **changes):
    """``(cfg, layout)`` with dotted-key ``changes`` applied to copies."""
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(cfg):
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value)
    if "optim.use_distributed_optimizer" in changes:
        layout = dataclasses.replace(
            layout, use_distributed_optimizer=changes["optim.use_distributed_optimizer"],
            distrib_optim_sharding_type="fully_reshardable")
    return cfg, layout


def fit_line(cfg, layout, vocab_size: int, sizes: RankSizes) -> str:
    """Whether ``sizes.total_bytes`` fits ``train.gpu_memory_gib``; if not, the first of the
    distributed optimizer (dp > 1), selective then full recompute and micro_batch_size 1, taken
    in that order and cumulatively, that makes it fit."""
    limit = float(cfg.train.get("gpu_memory_gib", 80.0))
    budget = limit * 2**30
    head = f"> fit: {format_bytes(sizes.total_bytes)} per rank"
    if sizes.total_bytes <= budget:
        return f"{head} fits train.gpu_memory_gib={limit:g}"
    steps = []
    if not layout.use_distributed_optimizer and \
            layout.data_parallel_size * layout.context_parallel_size > 1:
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
        vcfg, vlayout = _variant(cfg, layout, **changes)
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


def assumed_line(cfg, layout) -> str:
    """What the estimate assumed: the attention kind and where it came from
    (:func:`target_attention`), recompute, the distributed optimizer and the GPU memory."""
    kind, source = target_attention(cfg)
    scores = "no scores stored" if kind == "fused" else "scores stored"
    dp = layout.data_parallel_size * layout.context_parallel_size
    optim = (f"distributed optimizer over dp {dp}" if layout.use_distributed_optimizer
             else "no distributed optimizer")
    return (f"> assumed: attention {kind} ({scores}), {source}; recompute "
            f"{cfg.model.get('recompute_granularity') or 'none'} (model.recompute_granularity); "
            f"{optim} (optim.use_distributed_optimizer); checked against "
            f"train.gpu_memory_gib={float(cfg.train.get('gpu_memory_gib', 80.0)):g}")


def report(cfg, layout) -> str:
    """The dry-run text for ``cfg`` at ``layout`` (validated already).

    Raises:
        ValueError: megatron's ``TransformerConfig`` refuses the model config (its message).
    """
    from recipes.data import build_tokenizer
    from recipes.model import transformer_config
    from recipes.shapes import padded_vocab_size

    transformer_config(cfg, layout)  # megatron's own checks of the model fields
    vocab = build_tokenizer(cfg.data).vocab_size
    tp = layout.tensor_model_parallel_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp)
    sp_text = ("sequence parallel" if layout.sequence_parallel and tp > 1
               else "no sequence parallelism")
    if layout.context_parallel_size > 1:
        sp_text += (f", context parallel: {cfg.model.seq_length // layout.context_parallel_size} "
                    f"tokens of each sequence per rank")
    s = rank_sizes(cfg, layout, vocab)
    dtype = cfg.precision.params_dtype
    per_param = (s.param_bytes + s.grad_bytes + s.optimizer_bytes) / max(s.parameters, 1)
    sharded = (f", 1/{layout.data_parallel_size * layout.context_parallel_size} per rank: "
               f"distributed optimizer"
               if layout.use_distributed_optimizer else "")
    if sharded and s.expert_parameters:
        sharded += f"; routed experts 1/{layout.expert_data_parallel_size}: expert data parallel"
    rc = cfg.model.get("recompute_granularity")
    kind = target_attention(cfg)[0]
    stage = " (most loaded pipeline stage)" if layout.pipeline_model_parallel_size > 1 else ""
    lines = [
        "> dry run: config valid; nothing built, no process started",
        f"> layout: {layout.describe()}",
        f"> model: {cfg.model.name}, {s.total_parameters:,} parameters "
        f"(vocabulary {vocab:,} tokens, {padded:,} rows padded)",
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
        assumed_line(cfg, layout),
        fit_line(cfg, layout, vocab, s),
    ]
    try:
        from recipes.data import check_data_paths

        check_data_paths(cfg.data)
    except (ValueError, FileNotFoundError) as exc:
        lines.append(f"> data not checked: {exc} (a real run refuses this before launch)")
    if cfg.model.get("num_moe_experts"):
        lines.insert(3, f"> MoE: {s.active_parameters:,} active parameters per token "
                        f"(top-{cfg.model.moe_router_topk} of {cfg.model.num_moe_experts} experts); "
                        f"per rank {s.expert_parameters:,} routed-expert parameters, "
                        f"{format_bytes(s.expert_parameters * _BYTES[dtype])} ({dtype})")
    if layout.gtp_remat_size > 1:
        lines.append(
            f"> GTP: gtp_remat_size={layout.gtp_remat_size}, pad_for_alignment="
            f"{layout.pad_for_alignment}: {s.gtp_padding_rows:,} padding rows in the TP-local "
            f"GTP weights (a tail suffix, held by the last GTP ranks)")
    return "\n".join(lines)
