"""The LLaVA family's own ``model`` fields (megatron's ``LLaVAModel``; docs/llava.md), merged
into the run's ``model`` schema (``recipes.config.schema.ModelConfig``). The shared fields are
its language model's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LLaVAFields:
    """megatron's CLIP ViT and an MLP projector in front of the language model: the ViT's dims
    are the vision_* fields; images are img_h x img_w in patch_dim x patch_dim patches."""

    vision_model_type: Optional[str] = None  # "clip"
    vision_num_layers: int = 2
    vision_hidden_size: int = 72
    vision_num_attention_heads: int = 4
    vision_ffn_hidden_size: int = 200
    # The projector (MultimodalProjector): "mlp", vision hidden -> this width -> hidden_size.
    vision_projection_type: str = "mlp"
    vision_projection_ffn_hidden_size: int = 128
    img_h: int = 32
    img_w: int = 32
    patch_dim: int = 8
    # Drop the ViT's class token before the language model (Megatron-LM's
    # --disable-vision-class-token).
    drop_vision_class_token: bool = False


# The family's fields set in every one of its configs and in no other family's.
REQUIRES = ("vision_model_type",)
# Its fields that size a parameter (beyond the shared ones, recipes.config.schema.SHAPE_FIELDS).
SHAPE_FIELDS = ("vision_model_type", "vision_num_layers", "vision_hidden_size",
                "vision_num_attention_heads", "vision_ffn_hidden_size", "vision_projection_type",
                "vision_projection_ffn_hidden_size", "img_h", "img_w", "patch_dim",
                "drop_vision_class_token")
