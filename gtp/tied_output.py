"""Tied embeddings under GTP on megatron-core 0.19.2.

With ``share_embeddings_and_output_weights``, megatron's ``GPTModel`` hands the word embedding's
weight to the output layer (``ColumnParallelLinear.forward(..., weight=...)``), whose own weight
is not allocated. Under GTP that weight is the embedding's ``GTPShardedParam``: this rank's
1/``gtp_remat_size`` share of the TP-local rows. The linear's forward already all-gathers a GTP
weight before its GEMM and reduce-scatters its gradient (``gtp_remat_size > 1``), as for its own
weight, but it first compares the supplied weight's local shape with the full one
(``(output_size_per_partition, input_size)``) and refuses every GTP shard.

:func:`install` narrows that one check: a supplied ``GTPShardedParam`` of this linear's GTP
group is checked on its logical shape (padding rows stripped,
``GTPShardedParam._unsharded_shape``) instead, then passed on unchanged; so is the last
pipeline stage's own copy of the tied weight, which megatron also supplies explicitly. Every
other call runs megatron's forward as it is.
"""

from __future__ import annotations

from mcore_compat.patches import megatron_patch

_INSTALLED = False


@megatron_patch("tensor_parallel.layers.ColumnParallelLinear.forward (the shape check of a "
                "supplied weight, for a GTP-sharded one)")
def install() -> None:
    """Let the output layer of a tied-embedding model take the embedding's GTP shard.

    Replaces ``megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward`` by a wrapper
    that, for a supplied ``GTPShardedParam`` of the linear's GTP group whose logical shape is
    ``(output_size_per_partition, input_size)``, runs megatron's forward with the weight held
    as the module's own for that call (skipping only the local-shape check); idempotent.

    Raises:
        RuntimeError: megatron-core is not the supported version (the patch gate); at forward,
            a supplied GTP weight of another logical shape, or one supplied to a linear that
            holds another weight.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTPShardedParam

    forward = layers.ColumnParallelLinear.forward

    def forward_with_gtp_weight(self, input_, weight=None, runtime_gather_output=None):
        if (not isinstance(weight, GTPShardedParam)
                or getattr(self, "gtp_remat_size", 1) != weight.group.size()):
            return forward(self, input_, weight=weight,
                           runtime_gather_output=runtime_gather_output)
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight._unsharded_shape) != expected:
            raise RuntimeError(f"supplied GTP weight's logical shape is "
                               f"{tuple(weight._unsharded_shape)}, not {expected} as expected")
        if weight is self.weight:  # the last pipeline stage's own copy of the tied weight
            return forward(self, input_, runtime_gather_output=runtime_gather_output)
        if self.weight is not None:
            raise RuntimeError("a GTP weight supplied to a ColumnParallelLinear that holds "
                               "another weight")
        # The module's weight slot is a plain attribute (None: skip_weight_param_allocation);
        # holding the shard there for one call is not a registration.
        self.__dict__["weight"] = weight
        try:
            return forward(self, input_, runtime_gather_output=runtime_gather_output)
        finally:
            self.__dict__["weight"] = None

    forward_with_gtp_weight.__wrapped__ = forward
    layers.ColumnParallelLinear.forward = forward_with_gtp_weight
    _INSTALLED = True
