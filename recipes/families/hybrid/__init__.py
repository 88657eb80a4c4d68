"""The hybrid family: Mamba, GatedDeltaNet, attention, MLP and MoE layers mixed by a
``hybrid_layer_pattern`` (NVIDIA's Nemotron-H, Qwen3-Next), built as megatron's ``HybridModel``
(``model.py``), with its parameter table (``params.py``); ``model.family: hybrid``, its Mamba and
GatedDeltaNet fields in ``schema.py``; its MoE layers (``E``) take the MoE family's fields,
rules and expert initialization."""

from recipes.families.family import ModelFamily
from recipes.families.hybrid import checks, formats, model, params, schema
from recipes.families.moe import model as moe_model, schema as moe_schema

FAMILY = ModelFamily(
    name="hybrid",
    transformer_config_fields=model.transformer_config_fields,
    layer_spec=model.layer_spec,
    build=model.build,
    parameter_shapes=params.parameter_shapes,
    building=model.building,
    # Same expert weights at every expert layout (the MoE family's; nothing without E layers).
    init_weights=moe_model.init_experts,
    check=checks.check,
    fields=schema.HybridFields,
    requires=schema.REQUIRES,
    takes_fields_of=("moe",),
    shape_fields=schema.SHAPE_FIELDS + moe_schema.SHAPE_FIELDS,
    formats=formats.FORMATS,
)
