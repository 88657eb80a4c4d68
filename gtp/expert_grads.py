"""Expert GTP (EGTP) gradients: two fixes of megatron-core 0.19.2.

With ``expert_gtp_remat_size`` (EGTP) > 1, megatron shards routed-expert weights over their own
remat group; its stock gradients are right only where the dense and the expert data-parallel
groups coincide (expert parallel size 1 and EGTP equal to the dense GTP size). Fix 2 is needed
with dense GTP alone too (GTP > 1, EGTP 1), wherever the experts have their own buckets (expert
parallel size > 1 or expert TP differing from TP):

1. **Expert tag** (:func:`tag_expert_params`). ``ColumnParallelLinear.__init__`` /
   ``RowParallelLinear.__init__`` mark an expert weight ``allreduce = False`` (reduced over the
   expert data-parallel group) only when ``use_expert_pgs`` (expert parallel size > 1 or expert
   TP differing from TP), and ``generalized_tensor_parallelism._gtp_slice_one_param`` drops the
   tag when it wraps the weight into a ``GTPShardedParam``. ``DistributedDataParallel`` then puts
   the EGTP shards in the dense buffer and all-reduces them over the dense data-parallel group,
   summing shards that hold different rows (and, at EP > 1, different experts). Fix: before DDP,
   every parameter of a routed expert (``SequentialMLP.local_experts``) gets ``allreduce =
   False`` back.
2. **Expert gradient scale** (:func:`scale_expert_gradients`). ``GTPShardedParam`` divides an
   expert weight gradient by the EGTP size before its reduce-scatter
   (``_prescale_wgrads_for_mean_rs``; ``finalize_model_grads`` averages a replicated one over
   the EGTP group), and ``DistributedDataParallel.__init__`` gives the expert buckets
   ``1 / dp_cp`` (the dense replicate size, which excludes the dense GTP group but holds the EGTP
   peers when GTP < EGTP): ``1 / (EGTP x dp)`` in all, where the mean over the data group is
   ``1 / (GTP x dp)``. With EGTP 1 that is ``1 / dp``: at GTP 2 x EP 2 the expert gradients came
   out twice ep2's (``lm loss`` unchanged under Adam, ``grad-norm`` not). Fix: after DDP, the
   expert buckets' ``gradient_scaling_factor`` is multiplied by ``EGTP / GTP``. Under per-token
   loss (``calculate_per_token_loss``) neither scale is applied (both reductions sum;
   ``finalize_model_grads`` divides by the token count) and nothing is changed.

Both are needed; tests/test_moe_layouts.py breaks each and sees the gradient norm
move.
"""

from __future__ import annotations

from mcore_compat.patches import megatron_patch

def expert_parameters(model):
    """``(name, param)`` of every routed-expert parameter of ``model`` (the params of each
    ``SequentialMLP``'s ``local_experts``)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for mod_name, module in model.named_modules():
        if isinstance(module, SequentialMLP):
            for name, param in module.local_experts.named_parameters():
                yield f"{mod_name}.local_experts.{name}", param


@megatron_patch("the allreduce tag megatron's SequentialMLP experts carry (lost in the GTP wrap)")
def tag_expert_params(model, expert_gtp_remat_size: int) -> int:
    """Fix 1: mark routed-expert params ``allreduce = False`` before DDP is built (only with
    ``expert_gtp_remat_size > 1``; otherwise megatron's tags are right and nothing changes).

    Returns:
        The number of params tagged.
    """
    if expert_gtp_remat_size <= 1:
        return 0
    n = 0
    for _, param in expert_parameters(model):
        param.allreduce = False
        n += 1
    return n


@megatron_patch("distributed.DistributedDataParallel's expert buckets' gradient_scaling_factor")
def scale_expert_gradients(ddp_model, expert_gtp_remat_size: int, gtp_remat_size: int) -> int:
    """Fix 2: multiply the gradient scaling factor of each expert bucket of ``ddp_model`` (a
    megatron ``DistributedDataParallel``) by ``expert_gtp_remat_size / gtp_remat_size``: also
    with dense GTP and no expert GTP (then ``1 / gtp_remat_size``).

    Returns:
        The number of buckets rescaled (0 where the two GTP sizes are equal, where the experts
        share the dense buckets (no expert bucket), or under per-token loss).

    """
    if expert_gtp_remat_size == gtp_remat_size \
            or getattr(ddp_model.config, "calculate_per_token_loss", False):
        return 0
    factor = expert_gtp_remat_size / gtp_remat_size
    n = 0
    for buffer in ddp_model.expert_parallel_buffers:
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor *= factor
            n += 1
    return n
