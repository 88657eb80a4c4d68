"""TransformerEngine or not: which megatron layer spec a model uses, and the FP8/FP4 fields the
``gtp.quantization`` recipe sets.

With TransformerEngine importable, models use megatron's TransformerEngine layer spec
(``get_gpt_layer_with_transformer_engine_spec``) and a quantized recipe sets megatron's
``TransformerConfig`` fields, as Megatron-LM's ``--fp8-format`` / ``--fp8-recipe`` / ``--fp4-format``
do:

==========  ==========================================
recipe      TransformerConfig fields
==========  ==========================================
none        (none)
fp8         ``fp8="hybrid"`` (E4M3 forward, E5M2 gradients), ``fp8_recipe="tensorwise"``
mxfp8       ``fp8="e4m3"``, ``fp8_recipe="mxfp8"``
nvfp4       ``fp4="e2m1"``, ``fp4_recipe="nvfp4"``
==========  ==========================================

Without it, megatron's local spec (``get_gpt_layer_local_spec``), no quantization field, and the
recipe only sets the GTP alignment (``recipes.validate`` prints a one-line notice).
"""

from __future__ import annotations

import importlib

QUANTIZATION_FIELDS: dict[str, dict] = {
    "none": {},
    "fp8": {"fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "mxfp8": {"fp8": "e4m3", "fp8_recipe": "mxfp8"},
    "nvfp4": {"fp4": "e2m1", "fp4_recipe": "nvfp4"},
}


def transformer_engine_usable() -> bool:
    """Whether ``transformer_engine.pytorch`` imports in this process."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install (missing CUDA libs)
        return False
    return True


def config_fields(quantization: str, use_te: bool) -> dict:
    """``TransformerConfig`` keyword arguments for the layer implementation and ``quantization``.

    Args:
        quantization: ``gtp.quantization`` (none | fp8 | mxfp8 | nvfp4).
        use_te: TransformerEngine layers (:func:`transformer_engine_usable`).

    Returns:
        ``transformer_impl`` ("transformer_engine" or "local") plus, with TransformerEngine,
        the table's FP8/FP4 fields.

    Raises:
        ValueError: an unknown ``quantization``.
    """
    if quantization not in QUANTIZATION_FIELDS:
        raise ValueError(f"gtp.quantization={quantization!r}: valid are {sorted(QUANTIZATION_FIELDS)}")
    if not use_te:
        return {"transformer_impl": "local"}
    return {"transformer_impl": "transformer_engine", **QUANTIZATION_FIELDS[quantization]}


def spec_builder(model_cfg, use_te: bool) -> tuple[str, dict]:
    """``(function name in megatron.core.models.gpt.gpt_layer_specs, keyword arguments)`` of the
    layer spec. The TransformerEngine spec reads the norm from ``TransformerConfig.normalization``
    (its fused layer-norm linears); the local spec takes it as an argument."""
    if use_te:
        return "get_gpt_layer_with_transformer_engine_spec", {}
    return "get_gpt_layer_local_spec", {"normalization": model_cfg.get("normalization", "LayerNorm")}


def layer_spec(model_cfg, use_te: bool):
    """megatron's GPT layer spec (a ``ModuleSpec``) per :func:`spec_builder`."""
    name, kwargs = spec_builder(model_cfg, use_te)
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    return getattr(specs, name)(**kwargs)
