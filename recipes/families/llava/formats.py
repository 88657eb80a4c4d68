"""The LLaVA family's formats as ``gtp/`` reads and writes them (registered in ``pyproject.toml``
under the entry-point group ``gtp.model_families``): none yet. An export of a LLaVA checkpoint
is refused with the reason; its GTP weights' stock-format names are the GPT family's patterns
(``linear_qkv``, ``linear_fc1``, ... under ``vision_model.`` / ``vision_projection.``), but the
stock format is refused before launch for this family (``checks.py``).

No megatron, Hydra or torch at import (the ``gtp`` command line loads it).
"""

from __future__ import annotations

from gtp.families import ExportError, FamilyFormats


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


FORMATS = FamilyFormats(name="llava", architectures=(), architecture=architecture)
