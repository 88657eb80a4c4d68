"""Check a composed config before any process starts.

Every error names the bad value and what would be valid. :func:`validate` runs in ``train.py``
(one process, before launch) and again in each worker (cheap, guards direct ``torchrun`` use).
"""

from __future__ import annotations

import os
import sys

from gtp.alignment import validate_gtp_dims
from ckpt.format.records import CHECKPOINT_FORMATS
from recipes.model import context_parallel, mla, mtp, te
from ckpt.io import CheckpointError
from recipes.config.errors import ConfigError
from recipes.families import check_family_fields, family_of, gtp_weight_dims
from recipes.model.gtp_setup import overlap_settings, weight_reuse
from recipes.metrics.logger import CONSOLE_LINES, LOGGER_MODES
from recipes.run.optim import LR_DECAY_STYLES, optim_refusal
from recipes.config.parallel_dims import ParallelDims, check_positive
from recipes.run.preemption import EXIT_SIGNALS


def _has_validation_share(split) -> bool:
    """True when ``data.split`` (``"train,valid,test"`` weights) gives validation a weight > 0;
    a malformed split is left to the data pipeline's own error."""
    try:
        weights = [float(w) for w in str(split).replace("/", ",").split(",")]
    except ValueError:
        return True
    return len(weights) > 1 and weights[1] > 0


def validate(cfg, world_size: int, plan=None) -> ParallelDims:
    """Validate the whole composed config for ``world_size`` processes, one config group after
    another (the process grid first: ``ParallelDims.from_config``).

    ``plan``: the :class:`ckpt.io.manager.ResumePlan` of ``checkpoint.load`` when this
    process has resolved it (its checkpoint is then not opened again).

    Returns:
        The resolved :class:`ParallelDims`.

    Raises:
        ConfigError: the first problem found, naming the key, its value and what is valid.
    """
    from recipes.model import moe
    parallel_dims = ParallelDims.from_config(cfg, world_size)
    family = family_of(cfg.model)  # model.family names a registered family
    check_family_fields(cfg.model)
    if family.check is not None:
        family.check(cfg, parallel_dims)
    moe.check(cfg, parallel_dims)
    mla.check(cfg, parallel_dims)
    mtp.check(cfg, parallel_dims)
    context_parallel.check(cfg, parallel_dims)
    _check_model(cfg, parallel_dims)
    _check_batches(cfg, parallel_dims)
    if parallel_dims.gtp_remat_size > 1:
        _check_gtp(cfg, parallel_dims)
    _check_optim(cfg, parallel_dims)
    _check_train(cfg)
    _check_outputs(cfg, plan)
    _announce_quantization(cfg, parallel_dims)
    return parallel_dims


def _check_model(cfg, parallel_dims: ParallelDims) -> None:
    """``model`` and ``precision``: positive sizes, the pipeline split, the options, the sizes
    tensor parallelism divides (the sequence too, under sequence parallelism)."""
    from recipes.model.build import PARAMS_DTYPES

    m, tp = cfg.model, parallel_dims.tensor_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"):
        check_positive(f"model.{name}", m[name])
    _check_pipeline_split(cfg, parallel_dims)
    _check_model_options(m, tp)
    for name, value, div in (
        ("model.num_attention_heads", m.num_attention_heads, tp),
        ("model.ffn_hidden_size", m.ffn_hidden_size, tp),
        ("model.hidden_size", m.hidden_size, m.num_attention_heads),
    ):
        if value % div != 0:
            raise ConfigError(f"{name}={value} must be divisible by {div} (tensor_model_parallel_size={tp})"
                              if div == tp else f"{name}={value} must be divisible by model.num_attention_heads={div}")
    check_positive("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)
    cp = parallel_dims.context_parallel_size
    if parallel_dims.sequence_parallel and m.seq_length % (tp * cp):
        per = f" x context_parallel_size={cp}" if cp > 1 else ""
        raise ConfigError(
            f"model.seq_length={m.seq_length} must be divisible by tensor_model_parallel_size="
            f"{tp}{per} with parallelism.sequence_parallel=true (megatron scatters each "
            f"sequence's tokens over the TP ranks); e.g. model.seq_length="
            f"{max(tp * cp, m.seq_length - m.seq_length % (tp * cp))}, or "
            f"parallelism.sequence_parallel=false")
    if cfg.precision.params_dtype not in PARAMS_DTYPES:
        raise ConfigError(f"precision.params_dtype={cfg.precision.params_dtype!r}: valid are "
                          f"{tuple(PARAMS_DTYPES)}")


def _check_batches(cfg, parallel_dims: ParallelDims) -> None:
    """``data``: the source and the batch sizes the data group and the pipeline schedule split."""
    from recipes.data import SOURCES

    d = cfg.data
    if d.source not in SOURCES:
        raise ConfigError(f"data.source={d.source!r}: valid are {SOURCES}")
    if d.source == "shapes" and cfg.model.get("vision_model_type") is None:
        raise ConfigError("data.source='shapes' (images with captions) needs a vision-language "
                          "model (model.vision_model_type, e.g. model=llava_tiny); a text model "
                          "trains on pydoc, text, indexed or mock")
    check_positive("data.micro_batch_size", d.micro_batch_size)
    check_positive("data.global_batch_size", d.global_batch_size)
    # Batches are split over the full data group, dp x gtp_remat_size: GTP peers read different
    # micro-batches (megatron's get_data_parallel_group(with_gtp_remat=True)).
    data_group = parallel_dims.data_parallel_size * parallel_dims.gtp_remat_size
    per_step = d.micro_batch_size * data_group
    if d.global_batch_size % per_step != 0:
        group = (f"data group size {data_group} (dp {parallel_dims.data_parallel_size} x "
                 f"gtp_remat_size {parallel_dims.gtp_remat_size}: GTP peers read different "
                 f"micro-batches)"
                 if parallel_dims.gtp_remat_size > 1 else f"data-parallel size {data_group}")
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} must be a multiple of "
            f"data.micro_batch_size={d.micro_batch_size} x {group} (= {per_step}) for layout "
            f"{parallel_dims.describe()}"
        )
    pp = parallel_dims.pipeline_model_parallel_size
    vpp = parallel_dims.virtual_pipeline_model_parallel_size
    micro_batches = d.global_batch_size // per_step
    if vpp and micro_batches % pp != 0:
        # megatron's interleaved schedule runs micro-batches in groups of pp per model chunk
        # (schedules.forward_backward_pipelining_with_interleaving refuses a partial group).
        raise ConfigError(
            f"parallelism.virtual_pipeline_model_parallel_size={vpp}: the interleaved schedule "
            f"needs the micro-batches per step (data.global_batch_size={d.global_batch_size} / "
            f"{per_step} = {micro_batches}) to be a multiple of "
            f"pipeline_model_parallel_size={pp}: set data.global_batch_size to a multiple of "
            f"{per_step * pp}"
        )


def _check_gtp(cfg, parallel_dims: ParallelDims) -> None:
    """``gtp`` when ``gtp_remat_size > 1``: the weights' dims and the overlap settings."""
    _check_gtp_dims(cfg, parallel_dims)
    try:
        overlap_settings(cfg.gtp, parallel_dims.pipeline_model_parallel_size,
                         te.uses_transformer_engine(cfg),
                         reused=weight_reuse(cfg.model))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_optim(cfg, parallel_dims: ParallelDims) -> None:
    """``optim``: the optimizer at this layout and precision, FP8 weight gathers, the lr
    schedule."""
    o, t = cfg.optim, cfg.train
    for refusal in (optim_refusal(o, cfg.precision.params_dtype, cfg.model.get("num_moe_experts")),
                    te.fp8_param_gather_refusal(cfg.gtp.quantization,
                                                cfg.gtp.get("fp8_param_gather", False),
                                                parallel_dims.use_distributed_optimizer)):
        if refusal:
            raise ConfigError(refusal)
    if o.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(f"optim.lr_decay_style={o.lr_decay_style!r}: valid are {LR_DECAY_STYLES}")
    if not (0 <= o.min_lr <= o.lr):
        raise ConfigError(f"optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]")
    check_positive("train.train_iters", t.train_iters)
    decay = o.lr_decay_iters or t.train_iters
    # megatron's OptimizerParamScheduler asserts warmup < decay steps (recipes.config.prelaunch clamps
    # warmup first); a resume taking its schedule from the checkpoint is not judged on this one.
    from_checkpoint = cfg.checkpoint.get("load") is not None and \
        not o.get("override_opt_param_scheduler", False)
    if o.lr_warmup_iters < 0 or (o.lr_warmup_iters >= decay and not from_checkpoint):
        raise ConfigError(
            f"optim.lr_warmup_iters={o.lr_warmup_iters} must lie in [0, {decay}) "
            f"(optim.lr_decay_iters, default train.train_iters={t.train_iters})"
        )


def _check_train(cfg) -> None:
    """``train``: evaluation, logging and exit settings."""
    t = cfg.train
    for name in ("eval_interval", "eval_iters"):
        if t.get(name, 0) < 0:
            raise ConfigError(f"train.{name}={t[name]} must be >= 0")
    if t.get("eval_iters", 0) and not _has_validation_share(cfg.data.split):
        raise ConfigError(f"train.eval_iters={t.eval_iters} needs a validation share in "
                          f"data.split={cfg.data.split!r} (train,valid,test weights, e.g. '98,2,0'), "
                          f"or train.eval_iters=0")
    check_positive("train.log_interval", t.log_interval)
    if t.get("exit_signal", "SIGTERM") not in EXIT_SIGNALS:
        raise ConfigError(f"train.exit_signal={t.exit_signal!r}: valid are {EXIT_SIGNALS}")
    for name in ("exit_interval", "exit_duration_in_mins"):
        if t.get(name) is not None and t[name] <= 0:
            raise ConfigError(f"train.{name}={t[name]} must be > 0 or null (never)")


def _check_outputs(cfg, plan) -> None:
    """``checkpoint`` and ``logger``: formats, intervals, the loaded checkpoint's vocabulary and,
    unless a dry run, the data files."""
    ck = cfg.checkpoint
    fmt = ck.get("format", "logical")
    if fmt not in CHECKPOINT_FORMATS:
        raise ConfigError(f"checkpoint.format={fmt!r} (old name gtp.checkpoint_layout): valid are "
                          f"{CHECKPOINT_FORMATS}")
    for key, valid in (("mode", LOGGER_MODES), ("console_line", CONSOLE_LINES)):
        if cfg.logger.get(key, valid[0]) not in valid:
            raise ConfigError(f"logger.{key}={cfg.logger.get(key)!r}: valid are {valid}")
    if ck.save_interval < 0:
        raise ConfigError(f"checkpoint.save_interval={ck.save_interval} must be >= 0 (0: never)")
    if ck.keep_last is not None and ck.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={ck.keep_last} must be >= 1 or null (keep all)")
    if ck.load is not None:
        _check_checkpoint_vocab(cfg, plan)
    if not cfg.train.get("dry_run", False):
        # A dry run sizes a recipe before its data exist; it says so in its report.
        _check_data_files(cfg.data)


def _check_pipeline_split(cfg, parallel_dims: ParallelDims) -> None:
    """megatron splits ``num_layers`` evenly over pp x vpp model chunks (no uneven split here)."""
    pp = parallel_dims.pipeline_model_parallel_size
    vpp = parallel_dims.virtual_pipeline_model_parallel_size
    if pp == 1:
        return
    chunks = pp * (vpp or 1)
    n = cfg.model.num_layers
    if n % chunks != 0:
        what = (f"pipeline_model_parallel_size={pp} x virtual_pipeline_model_parallel_size={vpp}"
                if vpp else f"pipeline_model_parallel_size={pp}")
        ok = sorted({c for c in range(1, n + 1) if n % c == 0})
        raise ConfigError(
            f"model.num_layers={n} is not divisible by {what} = {chunks} (each model chunk gets "
            f"num_layers / {chunks} layers): use a chunk count among {ok}, or set "
            f"model.num_layers to a multiple of {chunks}"
        )


def _check_data_files(d) -> None:
    """``data.paths`` name files that exist (checked here, before any model is built)."""
    from recipes.data import check_data_paths

    try:
        check_data_paths(d)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None


_NORMS = ("LayerNorm", "RMSNorm")
_POSITIONS = ("learned_absolute", "rope", "none")


def _check_model_options(m, tp: int) -> None:
    """Norm, positions and grouped-query attention (megatron asserts these later, less clearly)."""
    if m.get("normalization", "LayerNorm") not in _NORMS:
        raise ConfigError(f"model.normalization={m.normalization!r}: valid are {_NORMS}")
    if m.position_embedding_type not in _POSITIONS:
        raise ConfigError(f"model.position_embedding_type={m.position_embedding_type!r}: "
                          f"valid are {_POSITIONS}")
    if m.get("recompute_granularity") not in (None, "selective", "full"):
        raise ConfigError(f"model.recompute_granularity={m.recompute_granularity!r}: valid are "
                          f"null, 'selective', 'full'")
    groups = m.get("num_query_groups")
    if groups is None:
        return
    check_positive("model.num_query_groups", groups)
    if m.num_attention_heads % groups:
        raise ConfigError(f"model.num_query_groups={groups} must divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if groups % tp:
        raise ConfigError(
            f"model.num_query_groups={groups} must be divisible by tensor_model_parallel_size={tp}"
            f" (each TP rank holds whole K/V groups); valid tensor_model_parallel_size values: "
            f"{[d for d in range(1, groups + 1) if groups % d == 0]}")


def _check_checkpoint_vocab(cfg, plan=None) -> None:
    """The checkpoint to load is loadable and was trained with this run's real vocabulary
    size (``plan``: its resolved ``ResumePlan``, else it is opened here)."""
    from ckpt.adapt import vocab
    from ckpt.io import load_common

    if plan is None:
        path, common = load_common(cfg.checkpoint.load, cfg.checkpoint.load_iteration)
    else:
        path, common = plan.path, plan.common
    try:
        from recipes.data import build_tokenizer

        current = build_tokenizer(cfg.data).vocab_size
    except ValueError:
        return  # the data checks report it
    message = vocab.refusal(common.get(vocab.RECORD_KEY), current, path)
    if message:
        raise CheckpointError(message)


def _check_gtp_dims(cfg, parallel_dims: ParallelDims) -> None:
    """Every GTP-sharded TP-local dim 0 must shard over gtp_remat_size (pad 0 needs divisibility)."""
    g, pad = parallel_dims.gtp_remat_size, parallel_dims.pad_for_alignment
    tp = parallel_dims.tensor_model_parallel_size
    dims = {name: dim for name, dim in gtp_weight_dims(cfg, tp).items()
            if ".local_experts." not in name}
    try:
        validate_gtp_dims(dims.values(), g, pad)
    except ValueError as exc:
        bad = sorted({_short(name): dim for name, dim in dims.items() if dim % g}.items())
        named = ", ".join(f"{name} dim 0 = {dim}" for name, dim in bad)
        raise ConfigError(
            f"gtp.pad_for_alignment={pad} with gtp_remat_size={g} at "
            f"tensor_model_parallel_size={parallel_dims.tensor_model_parallel_size}: {named} "
            f"(TP-local rows) not divisible by {g}. {exc}"
        ) from None


def _short(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``linear_fc1``."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "weight" else name


def _announce_quantization(cfg, parallel_dims: ParallelDims) -> None:
    """One line, once per launch (not again in each worker), when a quantized recipe is chosen:
    what it quantizes with TransformerEngine (``recipes.model.te``), or, without it, that it only
    picks the GTP alignment."""
    quant = cfg.gtp.quantization
    if quant == "none":
        return
    dist = sys.modules.get("torch.distributed")
    if (dist is not None and dist.is_available() and dist.is_initialized()) or \
            int(os.environ.get("RANK", "0")) != 0:
        return  # a worker: the launching process already said it
    if parallel_dims.gtp_remat_size == 1:
        effect = "has no effect: GTP is off (gtp_remat_size=1)"
    elif cfg.gtp.pad_for_alignment is not None:
        effect = f"has no effect: gtp.pad_for_alignment={cfg.gtp.pad_for_alignment} is explicit"
    else:
        effect = ("only sets the GTP alignment "
                  f"(pad_for_alignment={parallel_dims.pad_for_alignment})")

    if te.uses_transformer_engine(cfg):
        fields = ", ".join(f"{k}={v}" for k, v in te.config_fields(
            quant, True, cfg.gtp.get("fp8_param_gather", False)).items())
        print(f"> gtp.quantization={quant}: TransformerEngine layers with {fields} "
              f"(GTP pad_for_alignment={parallel_dims.pad_for_alignment})", flush=True)
        return
    print(f"> note: gtp.quantization={quant} {effect}; without TransformerEngine (megatron's "
          f"local layers) nothing is quantized: weights and GEMMs stay "
          f"{cfg.precision.params_dtype}", flush=True)
