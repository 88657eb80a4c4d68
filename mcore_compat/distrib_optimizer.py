"""megatron-core 0.19.2's ``DistributedOptimizer`` state loading without TransformerEngine/apex,
fixed (``docs/cpu-compat.md``): every param's ``step`` restored, one ``step`` tensor per param."""

from __future__ import annotations

import torch

from mcore_compat.patches import megatron_patch


_PATCHED = False


@megatron_patch("optimizer.distrib_optimizer.DistributedOptimizer."
                "_set_main_param_and_optimizer_states and load_state_dict")
def install() -> None:
    """Fix megatron-core 0.19.2's distributed-optimizer load without TransformerEngine/apex
    (idempotent; refused on another version).

    There torch's Adam keeps ``step`` in each param's state, and
    ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every state tensor from
    the loaded entry, which never holds ``step`` (megatron restores it from the param groups):
    ``KeyError: 'step'``. The wrapper hands it the param's current (already restored) step.
    """
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states.__wrapped__ = original
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        untie_steps(self.optimizer)

    load_state_dict.__wrapped__ = original_load
    DistributedOptimizer.load_state_dict = load_state_dict
    _PATCHED = True


def untie_steps(torch_optimizer) -> int:
    """Give every parameter's state its own ``step`` tensor; returns how many were shared.

    megatron-core 0.19.2's ``DistributedOptimizer.load_state_dict`` (without apex/TE) puts one
    ``step`` tensor object into every parameter's state, and torch's
    ``Optimizer.load_state_dict`` keeps step tensors uncopied, so single-tensor Adam's
    ``step += 1`` per parameter would advance the shared step once per parameter per iteration
    (wrong bias corrections from the second iteration after a load on).

    Args:
        torch_optimizer: a ``torch.optim.Optimizer`` (megatron's ``.optimizer``).
    """
    seen, shared = set(), 0
    for state in torch_optimizer.state.values():
        step = state.get("step")
        if not isinstance(step, torch.Tensor):
            continue
        if id(step) in seen:
            state["step"] = step.detach().clone()
            shared += 1
        seen.add(id(state["step"]))
    return shared
