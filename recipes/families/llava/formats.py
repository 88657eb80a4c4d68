"""The LLaVA family's formats as ``ckpt/`` reads and writes them (given to it by
:mod:`recipes.families.formats`). An export to Hugging Face is refused with
the reason. Stock-format checkpoints are read: the GTP weights' names are the GPT family's
patterns (``linear_qkv``, ``linear_fc1``, ... under ``language_model.``, ``vision_model.`` and
``vision_projection.``), each of the three sub-models with its own dims (:func:`sub_model_dims`),
and the ViT's patch convolution, class token and ``ln_pre`` are stored as they are.

No megatron, Hydra or torch at import (the ``gtp`` command line loads it).
"""

from __future__ import annotations

import re
from typing import Mapping

from ckpt.families import ExportError, FamilyFormats

# The fields that size or count stored tensors (ckpt.format.records.unbounded_size).
SIZE_FIELDS = ("vision_num_layers", "vision_hidden_size", "vision_num_attention_heads",
               "vision_ffn_hidden_size", "vision_projection_ffn_hidden_size", "img_h", "img_w",
               "patch_dim")

# megatron's LLaVAModel: the language model, the CLIP ViT, the MLP projector.
SUB_MODELS = ("language_model.", "vision_model.", "vision_projection.")
# The ViT's params that GTP never shards and that are neither norms nor biases nor position
# embeddings (which the stock reader knows).
STORED_LOGICAL = (re.compile(r"^vision_model\.(conv1\.weight|class_token|ln_pre\.weight)$"),)


def architecture(model: dict) -> str | None:
    """None for a model without ``vision_model_type``.

    Raises:
        ExportError: for a vision-language model: no transformers class is written from it here
            (a LLaVA export needs the ViT, the projector and a processor config mapped, which
            this project does not do); the message names ``model.vision_model_type``.
    """
    kind = model.get("vision_model_type")
    if kind is None:
        return None
    raise ExportError(
        f"model.vision_model_type={kind!r}: a vision-language (LLaVA) checkpoint is not "
        f"exported to Hugging Face here: its CLIP ViT, projector and image processor have no "
        f"mapping to a transformers class in this project (only text-only GPT, Llama, MoE and "
        f"hybrid models export)")


def sizes(model: Mapping) -> list[tuple[str, object]]:
    """The ViT's, projector's and images' sizes of a LLaVA ``model`` config dict (none without
    ``vision_model_type``)."""
    if model.get("vision_model_type") is None:
        return []
    return [(f"model.{f}", model.get(f)) for f in SIZE_FIELDS]


def sub_model_dims(model: Mapping) -> dict | None:
    """``{key prefix: dims}`` of a recorded LLaVA ``model`` config (None without
    ``vision_model_type``): the language model's own dims; the ViT's ``vision_*`` dims (no
    SwiGLU, no query groups: megatron's CLIP config, ``model.py:vision_config``); the
    projector's ``vision_projection_ffn_hidden_size`` rows into the language model's
    ``hidden_size`` (no SwiGLU). Dims a config leaves null are left out (inferred from the
    tensors).

    Raises:
        ValueError: a dim that is not a number.
    """
    if model.get("vision_model_type") is None:
        return None
    language = _set(model, hidden_size="hidden_size", ffn_hidden_size="ffn_hidden_size",
                    num_attention_heads="num_attention_heads",
                    num_query_groups="num_query_groups", kv_channels="kv_channels")
    if model.get("swiglu") is not None:
        language["swiglu"] = bool(model["swiglu"])
    vision = _set(model, hidden_size="vision_hidden_size",
                  ffn_hidden_size="vision_ffn_hidden_size",
                  num_attention_heads="vision_num_attention_heads")
    if "num_attention_heads" in vision:  # CLIP: every head its own key/value
        vision["num_query_groups"] = vision["num_attention_heads"]
    projection = _set(model, hidden_size="hidden_size",
                      ffn_hidden_size="vision_projection_ffn_hidden_size")
    for dims in (vision, projection):
        dims["swiglu"] = False
    return dict(zip(SUB_MODELS, (language, vision, projection)))


def _set(model: Mapping, **fields: str) -> dict:
    """``{dim: int(model[field])}`` for each field the config sets (not null)."""
    return {dim: int(model[f]) for dim, f in fields.items() if model.get(f) is not None}


FORMATS = FamilyFormats(name="llava", architectures=(), architecture=architecture,
                        stored_logical=STORED_LOGICAL, sub_models=SUB_MODELS,
                        sub_model_dims=sub_model_dims, sizes=sizes)
