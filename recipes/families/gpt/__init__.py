"""The GPT family: dense GPT-2 and Llama-style decoders built as megatron's ``GPTModel``
(``model.py``), their parameter table (``params.py``) and their Hugging Face and stock-format
names (``formats.py``); ``model.family: gpt``, no fields of its own (``schema.py``)."""

from recipes.families.family import ModelFamily
from recipes.families.gpt import formats, model, params, schema

FAMILY = ModelFamily(
    name="gpt",
    transformer_config_fields=model.transformer_config_fields,
    layer_spec=model.layer_spec,
    build=model.build,
    parameter_shapes=params.parameter_shapes,
    fields=schema.GPTFields,
    requires=schema.REQUIRES,
    shape_fields=schema.SHAPE_FIELDS,
    formats=formats.FORMATS,
)
