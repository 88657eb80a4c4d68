"""The optimizer state a layout test fills and checks: every (torch optimizer, model param,
fp32 main param, flat range) a rank's megatron optimizers hold, whatever their kind."""

from __future__ import annotations


def main_param_entries(optimizer):
    """(torch optimizer, model param, fp32 main param, flat range of the param or None) of every
    param this rank's optimizers (a megatron ``ChainedOptimizer``'s entries, nested ones
    flattened, or the one) hold
    state for: a distributed optimizer's shard of each param (its ``slice`` of the flattened
    param), a bf16 plain optimizer's fp32 copies, and an fp32 plain optimizer's params (the
    weight is the main param). Initializes each optimizer's state first (megatron's
    ``init_state_fn``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for co in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(co, "chained_optimizers"):  # nested: Muon's layer-wise distributed optimizer
            yield from main_param_entries(co)
            continue
        co.init_state_fn(co.optimizer, co.config)
        if isinstance(co, DistributedOptimizer):
            for gbuf_range_maps in co.gbuf_ranges:
                for maps in gbuf_range_maps.values():
                    for m in maps:
                        for p, rng in m["param_map"].items():
                            gi, go = co.model_param_group_index_map[p]
                            main = co.optimizer.param_groups[gi]["params"][go]
                            yield co.optimizer, p, main, slice(rng["param"].start,
                                                               rng["param"].end)
        elif hasattr(co, "fp32_from_float16_groups"):  # bf16 weights, plain optimizer
            for model_group, main_group in zip(co.float16_groups, co.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    yield co.optimizer, p, main, None
            for group in co.fp32_from_fp32_groups:
                for p in group:
                    yield co.optimizer, p, p, None
        else:  # fp32 weights, plain optimizer: the weight is the main param
            for group in co.optimizer.param_groups:
                for p in group["params"]:
                    yield co.optimizer, p, p, None


def opt_states(optimizer):
    """(torch optimizer, param) for every param of megatron's (chained) optimizer, each
    optimizer's state initialized first (megatron's ``init_state_fn``)."""
    for co in getattr(optimizer, "chained_optimizers", [optimizer]):
        co.init_state_fn(co.optimizer, co.config)
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                yield co.optimizer, p
