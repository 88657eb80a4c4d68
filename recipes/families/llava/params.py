"""The parameters megatron's ``LLaVAModel`` holds (CLIP ViT, MLP projector, GPT language model),
without building it (tests compare the table with a built model and a count made by hand)."""

from __future__ import annotations

from dataclasses import replace

from recipes.families.gpt import params as gpt_params
from recipes.families.llava.model import language_sequence_length, vision_sequence_length
from recipes.model.shapes import ParamShape


def vision_shapes(m) -> list[ParamShape]:
    """megatron's ``CLIPViTModel`` (``vision_model_type=clip``, local ViT layer spec), as
    ``named_parameters()`` orders it: ``conv1`` (patch embedding, no bias), the position
    embedding (one row per patch and class token), the class token, ``ln_pre``, then per layer
    LayerNorms, ``linear_qkv`` (3 x hidden rows, column-parallel), ``linear_proj``
    (row-parallel), ``linear_fc1`` / ``linear_fc2``, every linear with its bias. The linears'
    weights are GTP weights; ``conv1``, the embeddings, the class token, norms and biases not."""
    h, ffn, p = int(m.vision_hidden_size), int(m.vision_ffn_hidden_size), int(m.patch_dim)
    seq = vision_sequence_length(m)
    out = [ParamShape("vision_model.conv1.weight", (h, 3, p, p)),
           ParamShape("vision_model.position_embeddings.weight", (seq, h)),
           ParamShape("vision_model.class_token", (1, 1, h)),
           ParamShape("vision_model.ln_pre.weight", (h,)),
           ParamShape("vision_model.ln_pre.bias", (h,))]
    for i in range(int(m.vision_num_layers)):
        layer = f"vision_model.decoder.layers.{i}"
        out += [ParamShape(f"{layer}.input_layernorm.weight", (h,)),
                ParamShape(f"{layer}.input_layernorm.bias", (h,)),
                ParamShape(f"{layer}.self_attention.linear_qkv.weight", (3 * h, h), 0, True),
                ParamShape(f"{layer}.self_attention.linear_qkv.bias", (3 * h,), 0),
                ParamShape(f"{layer}.self_attention.linear_proj.weight", (h, h), 1, True),
                ParamShape(f"{layer}.self_attention.linear_proj.bias", (h,)),
                ParamShape(f"{layer}.pre_mlp_layernorm.weight", (h,)),
                ParamShape(f"{layer}.pre_mlp_layernorm.bias", (h,)),
                ParamShape(f"{layer}.mlp.linear_fc1.weight", (ffn, h), 0, True),
                ParamShape(f"{layer}.mlp.linear_fc1.bias", (ffn,), 0),
                ParamShape(f"{layer}.mlp.linear_fc2.weight", (h, ffn), 1, True),
                ParamShape(f"{layer}.mlp.linear_fc2.bias", (h,))]
    return out


def projection_shapes(m) -> list[ParamShape]:
    """megatron's ``MultimodalProjector`` (``mlp``): ``linear_fc1`` vision hidden ->
    ``vision_projection_ffn_hidden_size`` (column-parallel), ``linear_fc2`` -> the language
    ``hidden_size`` (row-parallel), both with biases; the weights are GTP weights."""
    vh, ffn, h = int(m.vision_hidden_size), int(m.vision_projection_ffn_hidden_size), m.hidden_size
    enc = "vision_projection.encoder"
    return [ParamShape(f"{enc}.linear_fc1.weight", (ffn, vh), 0, True),
            ParamShape(f"{enc}.linear_fc1.bias", (ffn,), 0),
            ParamShape(f"{enc}.linear_fc2.weight", (h, ffn), 1, True),
            ParamShape(f"{enc}.linear_fc2.bias", (h,))]


def language_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """The language model: the GPT family's table under ``language_model.``, its learned
    position embedding (if any) of ``language_max_sequence_length`` rows (text with the image's
    embeddings in place of the image token)."""
    out = []
    for p in gpt_params.parameter_shapes(m, padded_vocab):
        if p.name == "embedding.position_embeddings.weight":
            p = replace(p, shape=(language_sequence_length(m), m.hidden_size))
        out.append(replace(p, name=f"language_model.{p.name}"))
    return out


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of megatron's ``LLaVAModel`` in the order it builds them: the language
    model, the ViT, the projector.

    Args:
        m: the ``model`` config; padded_vocab: rows of the embedding and output layer.
    """
    return [*language_shapes(m, padded_vocab), *vision_shapes(m), *projection_shapes(m)]
