"""Where a run switches GTP on: the hooks the worker calls around model construction.

With ``gtp.gtp_remat_size == 1`` every hook does nothing.
"""

from __future__ import annotations

# The run config, kept by before_model for after_model's cross-check.
_STATE: dict = {}


def before_model(cfg, layout) -> None:
    """Install the portable backend (when TransformerEngine is not usable) and the num-zeros
    patch (``gtp.grad_stats``: GTP padding rows are not gradient elements), run megatron's recipe
    hook, then apply the resolved ``pad_for_alignment`` (megatron 0.19.2 would keep 16).

    First, at every layout (GTP off included): ``gtp.checkpoint_layout`` picks how GTP weights
    are checkpointed ("logical": ``gtp.checkpoint`` patch installed; "stock": megatron 0.19.2)."""
    from gtp import checkpoint as gtp_checkpoint

    gtp_checkpoint.configure(cfg.gtp.get("checkpoint_layout", "logical"))
    if layout.gtp_remat_size == 1:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    from gtp import alignment, backend, grad_stats

    backend.install()
    grad_stats.install()
    _STATE["cfg"] = cfg
    quant = cfg.gtp.quantization
    gtp_impl.configure_gtp_remat_from_recipe(
        fp4=quant == "nvfp4",
        fp8=quant in ("fp8", "mxfp8"),
        fp8_recipe="mxfp8" if quant == "mxfp8" else None,
    )
    alignment.apply_pad_for_alignment(layout.pad_for_alignment)


def after_model(model, layout) -> None:
    """Verify the built model's GTP shards carry the resolved alignment, and that the weights
    megatron sharded are exactly those pre-launch validation checked
    (``recipes.model.gtp_weight_dims``); rank 0 prints what it verified."""
    if layout.gtp_remat_size == 1:
        return
    import torch
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    from gtp import alignment
    from recipes.model import gtp_weight_dims

    checked = alignment.check_pad_applied(model, layout.pad_for_alignment)
    built = {name: p._unsharded_shape[0] for name, p in model.named_parameters() if is_gtp_param(p)}
    cfg = _STATE.get("cfg")
    if cfg is not None:
        expected = gtp_weight_dims(cfg, layout.tensor_model_parallel_size)
        if built != expected:
            diff = sorted(set(built.items()) ^ set(expected.items()))
            raise RuntimeError(
                "GTP-sharded weights (name, TP-local dim 0) differ from what pre-launch validation "
                f"checked (recipes.model.gtp_weight_dims): {diff}"
            )
    if torch.distributed.get_rank() == 0:
        pad_rows = sum(p.pad_length for p in model.parameters() if is_gtp_param(p))
        print(f"> GTP: {checked} weights sharded over gtp_remat_size={layout.gtp_remat_size}, "
              f"pad_for_alignment={layout.pad_for_alignment} verified on the built model "
              f"({pad_rows} padding rows in all)", flush=True)


def after_ddp(ddp_model, layout) -> None:
    """megatron's ``classify_gtp_remat_chains``: tag GTP params before the first forward."""
    if layout.gtp_remat_size == 1:
        return
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    gtp_impl.classify_gtp_remat_chains(ddp_model)
