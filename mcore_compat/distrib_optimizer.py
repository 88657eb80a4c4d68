"""megatron-core 0.19.2's ``DistributedOptimizer`` checkpoint state, fixed (``docs/cpu-compat.md``):
without TransformerEngine/apex every param's ``step`` restored, one ``step`` tensor per param; on
any backend, the ``fully_reshardable`` save of a buffer with more than one bucket."""

from __future__ import annotations

import torch

from mcore_compat import fs_model_space
from mcore_compat.patches import megatron_patch


_PATCHED = False


@megatron_patch("optimizer.distrib_optimizer.DistributedOptimizer."
                "_set_main_param_and_optimizer_states, load_state_dict and "
                "sharded_param_state_fully_reshardable")
def install() -> None:
    """Fix megatron-core 0.19.2's distributed-optimizer checkpoint state (idempotent; refused on
    another version): the load without TransformerEngine/apex, and the ``fully_reshardable``
    save of a buffer split into buckets (:func:`with_bucket_padding`).

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

    original_save = DistributedOptimizer.sharded_param_state_fully_reshardable

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        dp_zero = self.get_parameter_state_dp_zero
        self.get_parameter_state_dp_zero = (
            lambda *a, **k: with_bucket_padding(self.buffers, dp_zero(*a, **k)))
        try:
            return original_save(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero  # the class's method again

    sharded_param_state_fully_reshardable.__wrapped__ = original_save
    DistributedOptimizer.sharded_param_state_fully_reshardable = (
        sharded_param_state_fully_reshardable)
    fs_model_space.install()  # each DP rank's own range (mcore_compat.fs_model_space)
    _PATCHED = True


def with_bucket_padding(buffers, state):
    """``DistributedOptimizer.get_parameter_state_dp_zero``'s world tensors laid out as the grad
    buffer is, with the padding between buckets put back.

    megatron-core 0.19.2's ``get_parameter_state_dp_zero`` concatenates each bucket's unpadded
    elements ("gets rid of the padding between buckets"), while
    ``sharded_param_state_fully_reshardable`` slices those tensors at each param's
    ``param_index_map`` range, an offset in the padded buffer. With one bucket they agree. A
    buffer split into buckets (megatron gives a ``shared_embedding`` param its own: under
    pipeline parallelism the first stage's word embedding of a tied or multi-token-prediction
    model, and the last stage's copy of it) shifts every param after the first bucket's end
    padding, and the last ones read past the end, which megatron pads with zeros ("param range
    exceeds unpadded buffer"): the saved main params and moments of those params were wrong.

    Args:
        buffers: the optimizer's grad buffers (``DistributedOptimizer.buffers``), whose
            ``buckets`` give each bucket's ``offset`` (padded) and ``numel_unpadded``.
        state: ``get_parameter_state_dp_zero``'s result, ``{gbuf_idx: {dtype: {key: fp32 [sum
            of unpadded bucket sizes], "numel_unpadded": int}}}`` (None on ranks that get none).

    Returns:
        ``state`` with each tensor of ``buffer.numel`` elements (fp32, CPU), every bucket's
        elements at its own offset and zeros between buckets; ``numel_unpadded`` unchanged.
    """
    if state is None:
        return None
    for gbuf_idx, by_dtype in state.items():
        if not isinstance(gbuf_idx, int):
            continue  # "buckets_coalesced"
        buffer = buffers[gbuf_idx]
        for world in by_dtype.values():
            for key, flat in world.items():
                if not isinstance(flat, torch.Tensor):
                    continue
                padded = torch.zeros(buffer.numel, dtype=flat.dtype, device=flat.device)
                start = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    padded[bucket.offset:bucket.offset + n] = flat[start:start + n]
                    start += n
                world[key] = padded
    return state


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
