"""The hybrid family: Mamba, GatedDeltaNet, attention and MLP layers mixed by a
``hybrid_layer_pattern`` (NVIDIA's Nemotron-H, Qwen3-Next), built as megatron's ``HybridModel``
(``model.py``), with its parameter table (``params.py``); ``model.family: hybrid``, its Mamba and
GatedDeltaNet fields in ``schema.py``."""

from recipes.families.family import ModelFamily
from recipes.families.hybrid import checks, formats, model, params, schema

FAMILY = ModelFamily(
    name="hybrid",
    transformer_config_fields=model.transformer_config_fields,
    layer_spec=model.layer_spec,
    build=model.build,
    parameter_shapes=params.parameter_shapes,
    building=model.building,
    check=checks.check,
    fields=schema.HybridFields,
    requires=schema.REQUIRES,
    shape_fields=schema.SHAPE_FIELDS,
    formats=formats.FORMATS,
)
