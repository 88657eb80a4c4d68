"""The LLaVA family's megatron side: megatron's ``LLaVAModel`` (a CLIP ViT, an MLP projector and
a GPT/Llama language model), its three ``TransformerConfig`` s and its specs."""

from __future__ import annotations

import contextlib

from recipes.families.gpt import model as gpt_model

# The ViT kinds and projector kinds run here (megatron's names).
VISION_MODEL_TYPES = ("clip",)
PROJECTION_TYPES = ("mlp",)
# Fields of the language model's TransformerConfig the ViT's and the projector's share: the
# run-wide ones recipes.model.build sets (parallel sizes, dtype, CPU init, fusions off, GTP).
RUN_WIDE = ("tensor_model_parallel_size", "use_cpu_initialization", "params_dtype", "bf16",
            "pipeline_dtype", "bias_activation_fusion", "masked_softmax_fusion",
            "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
            "gtp_weight_remat_size", "init_method_std", "hidden_dropout", "attention_dropout",
            "calculate_per_token_loss")


def is_llava(m) -> bool:
    """Whether a ``model`` config is a vision-language one (``vision_model_type`` not null)."""
    return m.get("vision_model_type") is not None


def vision_sequence_length(m) -> int:
    """The CLIP ViT's sequence: ``(img_h / patch_dim) * (img_w / patch_dim)`` patches and one
    class token."""
    return (int(m.img_h) // int(m.patch_dim)) * (int(m.img_w) // int(m.patch_dim)) + 1


def image_sequence_length(m) -> int:
    """Image embeddings one image puts into the language model's sequence: the ViT's sequence,
    less its class token with ``drop_vision_class_token`` (megatron's
    ``get_num_image_embeddings`` for CLIP)."""
    return vision_sequence_length(m) - (1 if m.get("drop_vision_class_token", False) else 0)


def language_sequence_length(m) -> int:
    """The language model's sequence (megatron's ``language_max_sequence_length``): the
    ``seq_length`` text tokens with the one image token replaced by the image's embeddings."""
    return int(m.seq_length) - 1 + image_sequence_length(m)


def transformer_config_fields(m, dims) -> dict:
    """The language model's ``TransformerConfig`` fields: the GPT family's."""
    return gpt_model.transformer_config_fields(m, dims)


def layer_spec(m, config, use_te: bool, vp_stage=None):
    """The language model's local GPT layer spec whether TransformerEngine is there or not
    (``model.transformer_impl=transformer_engine`` is refused: the family is run local)."""
    return gpt_model.layer_spec(m, config, False, vp_stage)


def _sub_config(config, **fields):
    """A ``TransformerConfig`` with ``config`` 's run-wide fields (:data:`RUN_WIDE`) and
    ``fields``; no pipeline, sequence or context parallelism (all refused)."""
    from megatron.core.transformer import TransformerConfig

    shared = {k: getattr(config, k) for k in RUN_WIDE}
    return TransformerConfig(**shared, **fields)


def vision_config(m, config):
    """The ViT's ``TransformerConfig``: the ``vision_*`` dims, megatron's CLIP defaults
    (LayerNorm, biases, exact GeLU, no query groups), ``vision_model_type`` set on it as
    Megatron-LM's ``get_vision_model_config`` does."""
    import torch.nn.functional as F

    out = _sub_config(
        config, num_layers=int(m.vision_num_layers), hidden_size=int(m.vision_hidden_size),
        num_attention_heads=int(m.vision_num_attention_heads),
        ffn_hidden_size=int(m.vision_ffn_hidden_size), add_bias_linear=True,
        normalization="LayerNorm", layernorm_epsilon=1e-5, activation_func=F.gelu)
    out.vision_model_type = str(m.vision_model_type)
    return out


def projection_config(m, config):
    """The projector's ``TransformerConfig``: an MLP of ``vision_projection_ffn_hidden_size``
    rows into the language model's ``hidden_size``, with biases and exact GeLU."""
    import torch.nn.functional as F

    return _sub_config(
        config, num_layers=1, hidden_size=int(m.hidden_size),
        num_attention_heads=int(m.vision_num_attention_heads),
        ffn_hidden_size=int(m.vision_projection_ffn_hidden_size), add_bias_linear=True,
        activation_func=F.gelu)


def build(m, config, spec, vocab: int, pre: bool, post: bool, vp_stage, tied: bool):
    """megatron's ``LLaVAModel`` (arguments as the GPT family's ``build``; pipeline stages are
    refused, so ``pre`` and ``post`` are both true): the ViT on megatron's local ViT layer
    spec, the projector's ``linear_fc1`` / ``linear_fc2`` column- / row-parallel."""
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    model = LLaVAModel(
        language_transformer_config=config, language_transformer_layer_spec=spec,
        language_vocab_size=vocab, language_max_sequence_length=language_sequence_length(m),
        vision_transformer_config=vision_config(m, config),
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=bool(m.drop_vision_class_token),
        vision_projection_config=projection_config(m, config),
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                   linear_fc2=RowParallelLinear),
        vision_projection_type=str(m.vision_projection_type),
        share_embeddings_and_output_weights=tied,
        language_position_embedding_type=m.position_embedding_type,
        language_rotary_percent=m.get("rotary_percent", 1.0),
        language_rotary_base=m.get("rotary_base", 10000),
        language_rope_scaling=m.get("rope_scaling", False),
        language_rope_scaling_factor=m.get("rope_scaling_factor", 8.0),
        pre_process=pre, post_process=post, img_h=int(m.img_h), img_w=int(m.img_w),
        patch_dim=int(m.patch_dim), vp_stage=vp_stage)
    # megatron's schedules ask the model for it; Megatron-LM's get_model sets it on every model.
    model.model_type = ModelType.encoder_or_decoder
    return model


@contextlib.contextmanager
def building():
    """While chunks are built: megatron's CLIP ViT and LLaVA without TransformerEngine and
    without CUDA (``mcore_compat.vision_cpu``)."""
    from mcore_compat import vision_cpu

    vision_cpu.install()
    yield
