"""The hybrid family's rules, before any process starts (``recipes.config.validate``)."""

from __future__ import annotations

from recipes.config.errors import ConfigError
from recipes.families.hybrid.model import (
    ATTENTION,
    GDN,
    GDN_FIELDS,
    MAMBA,
    MLP,
    MOE,
    MTP,
    PIPE,
    SUPPORTED,
    UNSUPPORTED,
    layer_symbols,
    mtp_parts,
)
from recipes.families.hybrid.params import mamba_dims
from recipes.families.moe import checks as moe_checks
from recipes.config.parallel_dims import check_positive


def check(cfg, parallel_dims) -> None:
    """What a hybrid ``model`` needs of itself and of the run.

    Raises:
        ConfigError: an empty pattern, a layer symbol other than ``M``, ``G``, ``*``, ``-``,
            ``E`` (DeepSeek sparse attention, ... named with the reason), a pattern whose length
            is not ``num_layers``; MoE layers (``E``) without ``num_moe_experts`` or
            ``num_moe_experts`` without them, and with them what the MoE family refuses
            (``recipes.families.moe.checks``; TP > 1 without sequence parallelism:
            ``recipes.model.moe.check``), a ``moe_layer_freq`` (the pattern places them) and the
            stock checkpoint format; with Mamba layers, a Mamba size < 1
            and sizes that tensor parallelism cannot split (``nheads``, ``mamba_num_groups``);
            with GatedDeltaNet
            layers, a ``linear_*`` size < 1, value heads not a multiple of key heads, heads
            that tensor parallelism cannot split, and an activation other than SiLU
            (``model.swiglu=false``);
            and what is not run here: the stock checkpoint format under GTP (it cannot place
            ``in_proj``'s optimizer moments), context parallelism, virtual pipeline
            stages, TransformerEngine layers, zero-centred norms other
            than RMSNorm (``layernorm_zero_centered_gamma``); with an MTP part (``/``, megatron's
            unified pattern ``<main>/<mtp>/<mtp>...``): no decoder layer before it, ``|`` in it,
            an empty part, parts that differ, ``mtp_num_layers`` other than the parts' count
            (also without ``/``), the stock checkpoint format (not tested here).
    """
    m = cfg.model
    pattern = str(m.hybrid_layer_pattern)
    key = f"model.hybrid_layer_pattern={pattern!r}"
    valid = ", ".join(f"{s!r} {what}" for s, what in SUPPORTED.items())
    if not pattern:
        raise ConfigError(f"{key} is empty: give one symbol a layer ({valid}), or "
                          f"model.family=gpt model.hybrid_layer_pattern=null for a transformer-only "
                          f"model")
    _check_mtp(cfg, pattern, key)
    for symbol in dict.fromkeys(pattern):
        if symbol in SUPPORTED or symbol == MTP:
            continue
        if symbol == PIPE:
            raise ConfigError(f"{key}: '|' stage boundaries are not supported here; the layers "
                              f"split evenly over pipeline stages (valid symbols: {valid})")
        why = UNSUPPORTED.get(symbol, "not a layer symbol")
        raise ConfigError(f"{key}: {symbol!r}: {why} (valid symbols: {valid})")
    if len(layer_symbols(pattern)) != m.num_layers:
        raise ConfigError(f"{key} has {len(layer_symbols(pattern))} decoder layers but "
                          f"model.num_layers={m.num_layers}: one symbol a layer (the MTP part "
                          f"after '/' not counted)")
    _check_moe(cfg, parallel_dims, pattern, key)
    if MAMBA in pattern:
        _check_mamba_sizes(m, parallel_dims.tensor_model_parallel_size)
    if GDN in pattern:
        _check_gdn(m, parallel_dims.tensor_model_parallel_size)
    _check_run(cfg, parallel_dims, key)


def _check_mtp(cfg, pattern: str, key: str) -> None:
    """The MTP part (after ``/``) as megatron's ``parse_hybrid_pattern`` takes it, and
    ``mtp_num_layers`` equal to its depths (megatron's training arguments infer it from the
    pattern and override a different one: here both are said)."""
    m = cfg.model
    value = m.get("mtp_num_layers")
    parts, n = mtp_parts(pattern), int(value or 0)
    if n < 0:
        raise ConfigError(f"model.mtp_num_layers={n} must be >= 0 (null or 0: no MTP)")
    main = layer_symbols(pattern)
    # An example from what this model builds: attention, then its MoE layer or else an MLP.
    part = ATTENTION + (MOE if MOE in main else MLP)
    example = (f"e.g. model.hybrid_layer_pattern='{main or 'GE*E'}{(MTP + part) * max(n, 1)}' "
               f"model.mtp_num_layers={max(n, 1)}")
    depths = f"{len(parts)} MTP depth{'s' if len(parts) != 1 else ''}"
    refusals = (
        (bool(parts) and not main, "no decoder layer before '/'"),
        (any(PIPE in part for part in parts), "'|' in the MTP part: megatron places the MTP "
                                              "layers on the last pipeline stage"),
        (any(not part for part in parts), "an empty MTP part: each '/' is followed by one MTP "
                                          f"depth's layers ({example})"),
        (len(set(parts)) > 1, "MTP parts differ: megatron builds every MTP depth from one "
                              "pattern, repeated once a depth (e.g. '.../*E/*E')"),
        (n != len(parts), f"{depths} but model.mtp_num_layers="
                          f"{'null' if value is None else value}: give one '/' part per MTP "
                          f"layer and set model.mtp_num_layers to their count ({example})"),
        (bool(parts) and cfg.checkpoint.get("format", "logical") == "stock",
         "checkpoint.format=stock with MTP layers: not tested in a hybrid stack; use "
         "checkpoint.format=logical"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")


def _check_moe(cfg, parallel_dims, pattern: str, key: str) -> None:
    """``E`` layers and the MoE family's fields (this family takes them) agree; then the MoE
    family's own rules (the expert layout rules follow in ``recipes.model.moe.check``)."""
    m = cfg.model
    experts = m.get("num_moe_experts")
    if MOE not in pattern:
        if experts is not None:
            raise ConfigError(f"model.num_moe_experts={experts} with no MoE layer ('E') in "
                              f"{key}: add 'E' layers or set model.num_moe_experts=null")
        return
    if experts is None:
        raise ConfigError(f"{key} has MoE layers ('E'): set model.num_moe_experts (the routed "
                          f"experts of each)")
    freq = m.get("moe_layer_freq", 1)
    refusals = (
        (freq != 1, f"model.moe_layer_freq={freq!r}: the pattern's 'E' symbols place a hybrid "
                    f"model's MoE layers; leave model.moe_layer_freq=1"),
        (cfg.checkpoint.get("format", "logical") == "stock",
         "checkpoint.format=stock with MoE layers: not tested in a hybrid stack; use "
         "checkpoint.format=logical"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")
    moe_checks.check(cfg, parallel_dims)


def _check_mamba_sizes(m, tp: int) -> None:
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_chunk_size"):
        check_positive(f"model.{name}", m.get(name))
    if m.get("mamba_num_heads") is not None:
        check_positive("model.mamba_num_heads", m.mamba_num_heads)
    head = int(m.mamba_head_dim)
    if not m.get("mamba_num_heads") and (2 * m.hidden_size) % head:
        raise ConfigError(f"model.mamba_head_dim={head} must divide 2 * model.hidden_size = "
                          f"{2 * m.hidden_size} (Mamba's inner width), or set "
                          f"model.mamba_num_heads")
    d = mamba_dims(m)
    tp_name = f"tensor_model_parallel_size={tp}"
    for name, value, div, by in (
            ("Mamba heads", d["nheads"], tp, tp_name),
            ("model.mamba_num_groups", d["groups"], tp, tp_name),
            ("Mamba heads", d["nheads"], d["groups"], f"model.mamba_num_groups={d['groups']}")):
        if value % div:
            raise ConfigError(f"{name} = {value} must be divisible by {by} (megatron's "
                              f"MambaMixer splits heads and groups over TP ranks, and heads "
                              f"over groups)")


def _check_gdn(m, tp: int) -> None:
    for name in GDN_FIELDS:
        check_positive(f"model.{name}", m.get(name))
    keys, values = int(m.linear_num_key_heads), int(m.linear_num_value_heads)
    if values % keys:
        raise ConfigError(f"model.linear_num_value_heads={values} must be a multiple of "
                          f"model.linear_num_key_heads={keys} (GatedDeltaNet repeats each key "
                          f"head over its value heads)")
    for name, value in (("model.linear_num_key_heads", keys),
                        ("model.linear_num_value_heads", values)):
        if value % tp:
            raise ConfigError(f"{name}={value} must be divisible by tensor_model_parallel_size="
                              f"{tp} (megatron's GatedDeltaNet splits its heads over TP ranks)")
    if not m.swiglu:
        raise ConfigError("model.swiglu=false: GatedDeltaNet layers ('G') apply the model's "
                          "activation to their conv1d and output gate, and megatron-core "
                          "0.19.2 runs them with SiLU only; set model.swiglu=true (SiLU, the "
                          "MLPs gated, as Qwen3-Next)")


def _check_run(cfg, parallel_dims, key: str) -> None:
    m = cfg.model
    refusals = (
        (parallel_dims.gtp_remat_size > 1 and cfg.checkpoint.get("format", "logical") == "stock",
         "checkpoint.format=stock under GTP: megatron-core 0.19.2 gathers Mamba's in_proj for "
         "its checkpoint and cannot place the optimizer moments of it, and asserts on "
         "GatedDeltaNet's GTP in_proj; use checkpoint.format=logical"),
        (parallel_dims.context_parallel_size > 1,
         f"parallelism.context_parallel_size={parallel_dims.context_parallel_size}: not run here "
         f"(context_parallel_size=1)"),
        (bool(parallel_dims.virtual_pipeline_model_parallel_size),
         f"parallelism.virtual_pipeline_model_parallel_size="
         f"{parallel_dims.virtual_pipeline_model_parallel_size}: megatron-core 0.19.2 places a "
         f"hybrid model's virtual stages by '|' in the pattern, which this family does not "
         f"take; use virtual_pipeline_model_parallel_size=null"),
        (bool(m.get("layernorm_zero_centered_gamma"))
         and m.get("normalization", "LayerNorm") != "RMSNorm",
         f"model.layernorm_zero_centered_gamma=true with model.normalization="
         f"{m.get('normalization', 'LayerNorm')!r}: zero-centred norms are RMSNorm here"),
        (m.get("transformer_impl") == "transformer_engine",
         "model.transformer_impl='transformer_engine': the hybrid family builds megatron's "
         "local layers (its TransformerEngine spec fuses the norms into in_proj and linear_qkv, "
         "other weights than its parameter table); use 'local' or null"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")
