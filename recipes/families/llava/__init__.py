"""The LLaVA family: a vision-language model, megatron's ``LLaVAModel`` (CLIP ViT, MLP
projector and a GPT/Llama language model; ``model.py``), with its parameter table
(``params.py``), its rules (``checks.py``) and its formats (``formats.py``: export refused);
``model.family: llava``, its ViT, projector and image fields in ``schema.py``."""

from recipes.families.family import ModelFamily
from recipes.families.llava import checks, formats, model, params, schema

FAMILY = ModelFamily(
    name="llava",
    transformer_config_fields=model.transformer_config_fields,
    layer_spec=model.layer_spec,
    build=model.build,
    parameter_shapes=params.parameter_shapes,
    building=model.building,
    check=checks.check,
    fields=schema.LLaVAFields,
    requires=schema.REQUIRES,
    shape_fields=schema.SHAPE_FIELDS,
    formats=formats.FORMATS,
)
