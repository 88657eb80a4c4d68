"""megatron-core 0.19.2's multi-latent attention (``MLASelfAttention``) with its local layer
spec, made to build and to compute the gradients of the tp1 model at any tensor parallel size.

megatron's local spec (``get_gpt_layer_local_spec(multi_latent_attention=True)``) has three faults,
each fixed by a module the spec names instead (:func:`with_local_mla`); nothing of megatron is
patched:

1. ``MultiLatentAttention.__init__`` builds its core attention with ``k_channels`` and
   ``v_channels``, which only TransformerEngine's attention takes: the local
   ``DotProductAttention`` fails with ``TypeError: ... unexpected keyword argument
   'k_channels'``. :class:`MLADotProductAttention` takes them.
2. The local spec's down projections are ``ColumnParallelLinear`` (rows split over TP, output
   gathered). The key's RoPE part (``linear_kv_down_proj``'s last ``qk_pos_emb_head_dim`` rows)
   is then used by this TP rank's heads only, but the gather's backward takes this rank's slice
   of the gradient as if it were complete: at tp > 1 the RoPE rows of ``linear_kv_down_proj``
   and the hidden state's gradient lose the other ranks' heads (about 1% off in a tiny model).
   :class:`LocalMLASelfAttention` sums that part's gradient over the TP group.
3. ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums over the TP
   group the gradient of every parameter named ``q_layernorm`` when ``qk_layernorm``: right for
   ``SelfAttention``'s per-head norms (each rank sees its own heads), but MLA's ``q_layernorm``
   normalizes the gathered compressed query, whose gradient each TP rank already holds whole, so
   it came out ``tp`` times too large. Without sequence parallelism (with it each rank's norm
   sees its own tokens, and the sum is right) :class:`LocalMLASelfAttention` divides that
   gradient by the TP size before the sum.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class MLADotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` for MLA: queries and keys of ``k_channels`` per head,
    values of ``v_channels``.

    Its math needs nothing else: the scores are ``softmax_scale * q k^T`` over whatever the
    query/key width is (MLA passes its own ``softmax_scale``, YaRN's ``mscale`` included) and the
    context takes the value's width; only the output's width per TP rank
    (``hidden_size_per_partition``, megatron's ``kv_channels * heads / tp``) becomes ``v_channels
    * heads / tp``. Every head has its own key and value (no query groups: refused before launch).

    Input and output as ``DotProductAttention.forward``: query ``[sq, b, np, k_channels]``, key
    ``[sk, b, np, k_channels]``, value ``[sk, b, np, v_channels]`` -> ``[sq, b, np * v_channels]``.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LocalMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` with the local spec's ``ColumnParallelLinear`` down
    projections, its gradients those of the tp1 module (faults 2 and 3 of this module's
    docstring). Forward values are megatron's; at tp1 it computes exactly what megatron's does.
    """

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if tp > 1 and config.q_lora_rank is not None and not config.sequence_parallel:
            for param in self.q_layernorm.parameters():
                # Before accumulation (megatron's DDP hook adds .grad to main_grad after it).
                param.register_hook(lambda grad, tp=tp: grad / tp)

    def _qkv_down_projection(self, hidden_states):
        """``(q_compressed, kv_combined)`` as megatron's, with ``kv_combined`` already gathered
        over TP (``[s, b, kv_lora_rank + qk_pos_emb_head_dim]``; under sequence parallelism
        scattered back to ``[s / tp, b, ...]``): megatron then takes its other branch, where
        sequence parallelism gathers the RoPE part with a backward that sums over TP. Without
        sequence parallelism the RoPE part goes through ``copy_to_tensor_model_parallel_region``
        (identity; backward: the sum over TP of each rank's heads' gradient)."""
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == width:
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined,
                                                                     group=self.tp_group)
        kv, rope = torch.split(kv_combined, [self.config.kv_lora_rank,
                                             self.config.qk_pos_emb_head_dim], dim=-1)
        rope = copy_to_tensor_model_parallel_region(rope, group=self.tp_group)
        return q_compressed, torch.cat([kv, rope], dim=-1)


def with_local_mla(spec):
    """``spec`` (a layer ``ModuleSpec`` or a ``TransformerBlockSubmodules`` of layer specs) with
    every ``MLASelfAttention`` whose core attention is megatron's local ``DotProductAttention``
    made :class:`LocalMLASelfAttention` with :class:`MLADotProductAttention`; other specs
    unchanged (a copy where anything changed)."""
    if hasattr(spec, "layer_specs"):  # a decoder block: one spec per layer
        return dataclasses.replace(spec, layer_specs=[with_local_mla(s)
                                                      for s in spec.layer_specs])
    if not isinstance(spec, ModuleSpec) or spec.submodules is None:
        return spec
    attention = getattr(spec.submodules, "self_attention", None)
    if (not isinstance(attention, ModuleSpec) or attention.module is not MLASelfAttention
            or attention.submodules.core_attention is not DotProductAttention):
        return spec
    mla = dataclasses.replace(attention.submodules, core_attention=MLADotProductAttention)
    attention = dataclasses.replace(attention, module=LocalMLASelfAttention, submodules=mla)
    layer = dataclasses.replace(spec.submodules, self_attention=attention)
    return dataclasses.replace(spec, submodules=layer)
