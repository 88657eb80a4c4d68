"""A megatron-core ``LLaVAModel`` builder for ``tests/helpers/module_layouts.py``: the LLaVA
family's own build (``recipes.families.llava.model.build``) of ``llava_tiny`` with a non-gated
language MLP (``layout_goldens`` cuts a gated fc1 only with a run config; the GPT family's gated
fc1 is covered by ``tests/test_checkpoint_layouts.py``).

Its ViT is ``tests/helpers/vit.py``'s dims: at g2/a16 ``linear_fc1``'s 200 rows pad by 24; at
g4/a32 ``linear_proj`` / ``linear_fc2`` (72 rows, shards of 32) leave GTP rank 3 all padding.
The projector's ``linear_fc1`` (128 rows) and ``linear_fc2`` (64 rows) are GTP weights too.
"""

from __future__ import annotations

import functools

import torch

VOCAB, BATCH = 320, 2


def install() -> None:
    """megatron's CLIP ViT and LLaVA without TransformerEngine and CUDA (the family's shims)."""
    from mcore_compat import vision_cpu

    vision_cpu.install()


@functools.cache
def model_config():
    """``llava_tiny``'s ``model`` config (OmegaConf) with ``swiglu`` off."""
    from compose import make_cfg

    return make_cfg("model=llava_tiny", "data=shapes", "model.swiglu=false").model


def config(tp: int):
    """The language model's ``TransformerConfig`` at TP ``tp`` (fp32, CPU init, no fusions)."""
    from megatron.core.transformer import TransformerConfig

    from recipes.families.llava import model as llava

    return TransformerConfig(
        **llava.transformer_config_fields(model_config(), None), tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)


def build(tp: int):
    """The LLaVA model at the current process groups."""
    from recipes.families.llava import model as llava

    m, c = model_config(), config(tp)
    with llava.building():
        return llava.build(m, c, llava.layer_spec(m, c, False), VOCAB, True, True, None, False)


def loss(model) -> torch.Tensor:
    """The caption loss (a float32 scalar) of two fixed image-caption samples
    (``recipes.data.images``), as the training loop's ``loss_func`` takes it."""
    from recipes.data import ByteTokenizer
    from recipes.data.images import ShapesDataset
    from recipes.data.sampler import collate

    m = model_config()
    data = ShapesDataset(ByteTokenizer(), BATCH, m.seq_length, m.img_h, m.img_w, seed=7)
    b = collate([data[i] for i in range(BATCH)])
    out, mask = model(b["images"], b["tokens"], b["position_ids"], None, labels=b["labels"],
                      loss_mask=b["loss_mask"])
    return (out.float() * mask).sum() / mask.sum()
