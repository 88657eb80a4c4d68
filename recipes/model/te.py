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

With ``gtp.fp8_param_gather=true`` (fp8 or mxfp8 only) the weights themselves are kept in FP8
and gathered in FP8, as Megatron-LM's ``--fp8-param-gather``: ``TransformerConfig.fp8_param``
(megatron builds the layers under TransformerEngine's FP8 model init), and
``DistributedDataParallelConfig.fp8_param_gather`` follows that field (:func:`ddp_fields`).
Under GTP, megatron's weight all-gather then moves FP8 shards (``generalized_tensor_parallelism``,
native-FP8 GTP params) and checkpoints hold the dequantized values (``ckpt.format.logical_format``).

``model.transformer_impl=local`` builds megatron's local layers even where TransformerEngine
imports (:func:`uses_transformer_engine`). Without it, megatron's local spec (``get_gpt_layer_local_spec``), no quantization field, and the
recipe only sets the GTP alignment (``recipes.config.validate`` prints a one-line notice).
"""

from __future__ import annotations

import importlib

# model.transformer_impl besides null (which picks TransformerEngine where it imports).
TRANSFORMER_IMPLS = ("transformer_engine", "local")

QUANTIZATION_FIELDS: dict[str, dict] = {
    "none": {},
    "fp8": {"fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "mxfp8": {"fp8": "e4m3", "fp8_recipe": "mxfp8"},
    "nvfp4": {"fp4": "e2m1", "fp4_recipe": "nvfp4"},
}


# Quantization recipes whose weights megatron can keep in FP8 (TransformerConfig.fp8_param
# requires fp8 mode).
FP8_PARAM_RECIPES = ("fp8", "mxfp8")


def fp8_param_gather_refusal(quantization: str, fp8_param_gather: bool,
                             use_distributed_optimizer: bool) -> str | None:
    """Why ``gtp.fp8_param_gather=true`` cannot run with these settings, else None.

    Megatron keeps FP8 weights only in fp8 mode (``TransformerConfig.__post_init__``) and
    Megatron-LM accepts ``--fp8-param-gather`` only with the distributed optimizer (or FSDP).
    """
    if not fp8_param_gather:
        return None
    if quantization not in FP8_PARAM_RECIPES:
        return (f"gtp.fp8_param_gather=true keeps weights in FP8, which needs an FP8 recipe: "
                f"gtp.quantization={quantization!r}; valid are {list(FP8_PARAM_RECIPES)}")
    if not use_distributed_optimizer:
        return ("gtp.fp8_param_gather=true needs optim.use_distributed_optimizer=true (megatron "
                "keeps the fp32 main weights of FP8 params in the distributed optimizer)")
    return None


def transformer_engine_usable() -> bool:
    """Whether ``transformer_engine.pytorch`` imports in this process."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install (missing CUDA libs)
        return False
    return True


def uses_transformer_engine(cfg) -> bool:
    """Whether a run of ``cfg`` builds TransformerEngine layers: TransformerEngine imports
    (:func:`transformer_engine_usable`) and ``model.transformer_impl`` is not ``"local"``
    (null and ``"transformer_engine"`` take it when it imports; without it, local layers)."""
    return cfg.model.get("transformer_impl") != "local" and transformer_engine_usable()


def config_fields(quantization: str, use_te: bool, fp8_param_gather: bool = False) -> dict:
    """``TransformerConfig`` keyword arguments for the layer implementation and ``quantization``.

    Args:
        quantization: ``gtp.quantization`` (none | fp8 | mxfp8 | nvfp4).
        use_te: TransformerEngine layers (:func:`transformer_engine_usable`).
        fp8_param_gather: ``gtp.fp8_param_gather`` (checked by :func:`fp8_param_gather_refusal`).

    Returns:
        ``transformer_impl`` ("transformer_engine" or "local") plus, with TransformerEngine,
        the table's FP8/FP4 fields and ``fp8_param=True`` for FP8 weights.

    Raises:
        ValueError: an unknown ``quantization``.
    """
    if quantization not in QUANTIZATION_FIELDS:
        raise ValueError(f"gtp.quantization={quantization!r}: valid are {sorted(QUANTIZATION_FIELDS)}")
    if not use_te:
        return {"transformer_impl": "local"}
    fields = {"transformer_impl": "transformer_engine", **QUANTIZATION_FIELDS[quantization]}
    if fp8_param_gather and quantization in FP8_PARAM_RECIPES:
        fields["fp8_param"] = True
    return fields


def ddp_fields(config) -> dict:
    """``DistributedDataParallelConfig`` keyword arguments that follow the built
    ``TransformerConfig``: FP8 weights (``fp8_param``) are all-gathered in FP8."""
    return {"fp8_param_gather": bool(getattr(config, "fp8_param", False))}
