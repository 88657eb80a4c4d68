"""The MoE family's routing and layer rules, before any process starts
(``recipes.config.validate``; the expert layout rules: ``recipes.model.moe.check``).

megatron-core 0.19.2 checks some of these in ``TransformerConfig.__post_init__`` (expert bias
needs a sigmoid score, group-limited routing needs ``moe_router_num_groups`` dividing the
experts and ``moe_router_group_topk`` within it) as a traceback inside every worker, and takes
others silently (a group count without a group top-k, a pre-softmax with a sigmoid score, a
group top-k above the top-k): each is refused here in one line instead.
"""

from __future__ import annotations

from recipes.config.errors import ConfigError

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def check(cfg, parallel_dims) -> None:
    """The routing fields, the shared expert's width and ``moe_layer_freq`` of an MoE ``model``.

    Raises:
        ConfigError: the first problem, naming the value and what is valid: a shared-expert
            gate without a shared expert, a shared-expert width < 1; a score function other than softmax / sigmoid; expert bias without sigmoid, a negative bias update
            rate; ``moe_router_pre_softmax`` with sigmoid (megatron ignores it); a scaling factor
            <= 0; a group count without a group top-k (or the reverse), groups that do not divide
            the experts, a group top-k outside ``[1, min(groups, topk)]`` or whose groups hold
            fewer than top-k experts; ``moe_layer_freq`` not an int >= 1 nor a 0/1 list of
            ``num_layers`` entries with at least one MoE layer.
    """
    m = cfg.model
    if m.get("num_moe_experts") is None:
        return
    shared = m.get("moe_shared_expert_intermediate_size")
    if shared is not None and shared < 1:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={shared} must be >= 1 "
                          f"(the shared expert's width), or null: no shared expert")
    if m.get("moe_shared_expert_gate") and not shared:
        raise ConfigError("model.moe_shared_expert_gate=true without a shared expert: set "
                          "model.moe_shared_expert_intermediate_size (its width), or false")
    _check_scores(m)
    _check_groups(m)
    _check_layer_freq(m)


def _check_scores(m) -> None:
    score = m.get("moe_router_score_function", "softmax")
    if score not in SCORE_FUNCTIONS:
        raise ConfigError(f"model.moe_router_score_function={score!r}: valid are "
                          f"{SCORE_FUNCTIONS} (megatron's 'sqrtsoftplus' is not tested here)")
    if m.get("moe_router_enable_expert_bias", False) and score != "sigmoid":
        raise ConfigError(f"model.moe_router_enable_expert_bias=true with "
                          f"model.moe_router_score_function={score!r}: megatron's aux-loss-free "
                          f"expert bias needs sigmoid scores; set "
                          f"model.moe_router_score_function=sigmoid or "
                          f"model.moe_router_enable_expert_bias=false")
    rate = float(m.get("moe_router_bias_update_rate", 1e-3))
    if rate < 0:
        raise ConfigError(f"model.moe_router_bias_update_rate={rate} must be >= 0 (megatron's "
                          f"default 1e-3, DeepSeek-V3's)")
    if score == "sigmoid" and m.get("moe_router_pre_softmax", False):
        raise ConfigError("model.moe_router_pre_softmax=true with "
                          "model.moe_router_score_function='sigmoid': megatron ignores it (the "
                          "sigmoid top-k is renormalised at top-k > 1, taken as is at top-1); "
                          "set model.moe_router_pre_softmax=false")
    factor = m.get("moe_router_topk_scaling_factor")
    if factor is not None and not float(factor) > 0:
        raise ConfigError(f"model.moe_router_topk_scaling_factor={factor} must be > 0 (or null: "
                          f"no scaling; DeepSeek-V3's routed_scaling_factor is 2.5)")


def _check_groups(m) -> None:
    groups, group_topk = m.get("moe_router_num_groups"), m.get("moe_router_group_topk")
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        given = "moe_router_num_groups" if groups is not None else "moe_router_group_topk"
        other = "moe_router_group_topk" if groups is not None else "moe_router_num_groups"
        raise ConfigError(f"model.{given}={groups if groups is not None else group_topk} "
                          f"without model.{other}: group-limited routing needs both (megatron "
                          f"ignores a group count alone); set model.{other} or "
                          f"model.{given}=null")
    experts, topk = int(m.num_moe_experts), int(m.moe_router_topk)
    if groups < 1 or experts % groups:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(f"model.moe_router_num_groups={groups} must divide "
                          f"model.num_moe_experts={experts} into equal groups; valid: {valid}")
    if not 1 <= group_topk <= min(groups, topk):
        raise ConfigError(f"model.moe_router_group_topk={group_topk} must lie in [1, "
                          f"{min(groups, topk)}]: at most model.moe_router_num_groups={groups}, "
                          f"and at most model.moe_router_topk={topk} (megatron scores a group by "
                          f"its top topk // group_topk experts)")
    if group_topk * (experts // groups) < topk:
        raise ConfigError(f"model.moe_router_group_topk={group_topk} groups of "
                          f"{experts // groups} experts hold fewer than model.moe_router_topk="
                          f"{topk}: raise model.moe_router_group_topk to at least "
                          f"{-(-topk // (experts // groups))}")


def _check_layer_freq(m) -> None:
    freq, layers = m.get("moe_layer_freq", 1), int(m.num_layers)
    if freq is None or isinstance(freq, bool):
        raise ConfigError(f"model.moe_layer_freq={freq!r}: an int >= 1 (every N-th layer MoE) "
                          f"or a list of 0/1, one per layer")
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"model.moe_layer_freq={freq} must be >= 1, or a list of 0/1 "
                              f"per layer")
        return
    try:
        pattern = list(freq)
    except TypeError:
        pattern = None
    if pattern is None or isinstance(freq, str) or any(v not in (0, 1) or isinstance(v, bool)
                                                       for v in pattern):
        raise ConfigError(f"model.moe_layer_freq={freq!r}: an int >= 1 (every N-th layer MoE) "
                          f"or a list of 0/1, one per layer (1: MoE, 0: dense)")
    if len(pattern) != layers:
        raise ConfigError(f"model.moe_layer_freq has {len(pattern)} entries but model.num_layers"
                          f"={layers}: give one 0/1 per decoder layer")
    if 1 not in pattern:
        raise ConfigError(f"model.moe_layer_freq={pattern} has no MoE layer: set a 1, or "
                          f"model.family=gpt model.num_moe_experts=null for a dense model")
