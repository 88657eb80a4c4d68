"""A megatron-core ``CLIPViTModel`` builder for ``tests/helpers/module_layouts.py`` (local layer
spec, biases on, no TransformerEngine; ``mcore_compat.vision_cpu``).

Dims (hidden 72, 4 heads, ffn 200, 2 layers, 32x32 images in patches of 8: a sequence of 17)
make the two vision cases GTP checkpoints used to break: at g2/a16 ``linear_fc1``'s 200 rows pad
by 24 (shards of 112); at g4/a32 ``linear_proj`` / ``linear_fc2`` (72 rows) pad to 128 in shards
of 32, so GTP rank 3 holds only padding.
"""

from __future__ import annotations

import torch

IMG, PATCH, BATCH = 32, 8, 2


def install() -> None:
    from mcore_compat import vision_cpu

    vision_cpu.install()


def config(tp: int):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=72, num_attention_heads=4, ffn_hidden_size=200,
        tensor_model_parallel_size=tp, add_bias_linear=True, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, activation_func=F.gelu,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)


def build(tp: int):
    """The ViT at the current process groups, with megatron's default norms."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    return CLIPViTModel(config(tp), get_vit_layer_with_local_spec(), patch_dim=PATCH,
                        img_h=IMG, img_w=IMG)


def loss(model) -> torch.Tensor:
    """``mean(out ** 2)`` of fixed images ``[BATCH, 3, IMG, IMG]``."""
    images = torch.randn(BATCH, 3, IMG, IMG, generator=torch.Generator().manual_seed(7))
    return (model(images).float() ** 2).mean()
