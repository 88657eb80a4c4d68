"""Where a run switches GTP on: the hooks the worker calls around model construction.

With ``gtp.gtp_remat_size == 1`` every hook does nothing.
"""

from __future__ import annotations


def before_model(cfg, layout) -> None:
    """Install the portable backend (when TransformerEngine is not usable), run megatron's recipe
    hook, then apply the resolved ``pad_for_alignment`` (megatron 0.19.2 would keep 16)."""
    if layout.gtp_remat_size == 1:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    from gtp import alignment, backend

    backend.install()
    quant = cfg.gtp.quantization
    gtp_impl.configure_gtp_remat_from_recipe(
        fp4=quant == "nvfp4",
        fp8=quant in ("fp8", "mxfp8"),
        fp8_recipe="mxfp8" if quant == "mxfp8" else None,
    )
    alignment.apply_pad_for_alignment(layout.pad_for_alignment)


def after_model(model, layout) -> None:
    """Verify the built model's GTP shards carry the resolved alignment."""
    if layout.gtp_remat_size == 1:
        return
    from gtp import alignment

    alignment.check_pad_applied(model, layout.pad_for_alignment)


def after_ddp(ddp_model, layout) -> None:
    """megatron's ``classify_gtp_remat_chains``: tag GTP params before the first forward."""
    if layout.gtp_remat_size == 1:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    gtp_impl.classify_gtp_remat_chains(ddp_model)
