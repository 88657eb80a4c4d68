"""The MoE family: Mixtral / Qwen3-MoE-style decoders, megatron's ``GPTModel`` with MoE layers
(``model.py``), their parameter table (``params.py``) and their Hugging Face names
(``formats.py``); ``model.family: moe``, its expert fields in ``schema.py``, their rules in
``checks.py`` (the expert layout rules: ``recipes.model.moe``)."""

from recipes.families.family import ModelFamily
from recipes.families.gpt import model as gpt_model, schema as gpt_schema
from recipes.families.moe import checks, formats, model, params, schema

FAMILY = ModelFamily(
    name="moe",
    transformer_config_fields=model.transformer_config_fields,
    layer_spec=model.layer_spec,
    build=gpt_model.build,
    parameter_shapes=params.parameter_shapes,
    # Same expert weights at every expert layout (model.init_experts).
    building=model.experts_leave_rng_alone,
    init_weights=model.init_experts,
    check=checks.check,
    fields=schema.MoEFields,
    requires=schema.REQUIRES,
    shape_fields=gpt_schema.SHAPE_FIELDS + schema.SHAPE_FIELDS,  # MLA's too (GPT's fields)
    formats=formats.FORMATS,
)
