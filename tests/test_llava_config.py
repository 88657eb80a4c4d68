"""The LLaVA family before launch: which models it owns, its parameter table against counts
worked out by hand from llava_tiny's dims, the GTP weights (the two vision cases), the dry run,
the refusals, the export refusal and the image-caption data.

llava_tiny by hand:
* language model: hidden 64, 4 heads of 16 in 2 query groups, SwiGLU ffn 128, RMSNorm, no
  biases, rope, untied; byte vocab 257 padded to 320;
* ViT: hidden 72, 4 heads, ffn 200, 2 layers, LayerNorm and biases, 32x32 images in 8x8
  patches: 16 patches and a class token;
* projector: 72 -> 128 -> 64 with biases.
"""

from __future__ import annotations

import pytest
import torch
from compose import make_cfg

from ckpt.families import ExportError, for_export
from gtp.shards import gtp_padding
from recipes.families import family_of, gtp_weight_dims, parameter_counts, parameter_shapes
from recipes.model.shapes import local_shape
from recipes.config.validate import ConfigError, validate

LLAVA = ("model=llava_tiny", "data=shapes")
VOCAB = 320
# Language model, full: embedding and output 320 x 64; per layer two norms of 64, QKV
# (4 + 2 * 2) * 16 = 128 rows, proj 64 x 64, fc1 2 * 128 rows (gate, up), fc2 64 x 128.
LM_LAYER = 64 + 128 * 64 + 64 * 64 + 64 + 256 * 64 + 64 * 128
LANGUAGE = 2 * 320 * 64 + 2 * LM_LAYER + 64
# ViT, full: conv1 72 x 3 x 8 x 8 (no bias), position embedding 17 x 72, class token 72, ln_pre;
# per layer two LayerNorms, QKV 216 x 72 + 216, proj 72 x 72 + 72, fc1 200 x 72 + 200,
# fc2 72 x 200 + 72.
VIT_LAYER = 4 * 72 + 216 * 72 + 216 + 72 * 72 + 72 + 200 * 72 + 200 + 72 * 200 + 72
VISION = 72 * 3 * 8 * 8 + 17 * 72 + 72 + 2 * 72 + 2 * VIT_LAYER
PROJECTOR = 128 * 72 + 128 + 64 * 128 + 64
TOTAL = LANGUAGE + VISION + PROJECTOR

# One rank at tp2 x g2/a16: a GTP weight holds a padded shard of its TP-local rows (rows / tp
# column-parallel, all rows row-parallel with columns / tp): 160 vocab rows -> 80; QKV 64 -> 32;
# proj 64 -> 32 (x 32 columns); fc1 128 -> 64; fc2 64 -> 32 (x 64); ViT QKV 108 -> 64, proj 72
# -> 48 (x 36), fc1 100 -> 64, fc2 72 -> 48 (x 100); projector fc1 64 -> 32, fc2 64 -> 32 (x 64).
# Norms, biases (column-parallel biases halved), conv1, embeddings and class token as they are.
LM_LAYER_RANK = 64 + 32 * 64 + 32 * 32 + 64 + 64 * 64 + 32 * 64
VIT_LAYER_RANK = 4 * 72 + 64 * 72 + 108 + 48 * 36 + 72 + 64 * 72 + 100 + 48 * 100 + 72
PER_RANK_TP2_G2 = (2 * 80 * 64 + 2 * LM_LAYER_RANK + 64
                   + 72 * 3 * 64 + 17 * 72 + 72 + 2 * 72 + 2 * VIT_LAYER_RANK
                   + 32 * 72 + 64 + 32 * 64 + 64)


def test_llava_tiny_is_the_llava_family_and_its_count_is_worked_out_by_hand():
    m = make_cfg(*LLAVA).model
    assert family_of(m).name == "llava"
    assert TOTAL == 248_640
    assert parameter_counts(m, VOCAB) == (TOTAL, TOTAL)
    names = [p.name for p in parameter_shapes(m, VOCAB)]
    # language: embedding, 2 layers of 6, final norm, output; ViT: 5 + 2 layers of 12; projector 4
    assert len(names) == len(set(names)) == 15 + 29 + 4


def test_a_learned_position_embedding_covers_the_text_and_the_image_embeddings():
    # seq_length 32 text tokens: the image token gives way to 17 image embeddings (48 rows),
    # or 16 when the class token is dropped (47); the ViT keeps its 17 positions either way.
    m = make_cfg(*LLAVA, "model.position_embedding_type=learned_absolute").model
    assert parameter_counts(m, VOCAB)[0] == TOTAL + 48 * 64
    m = make_cfg(*LLAVA, "model.position_embedding_type=learned_absolute",
                 "model.drop_vision_class_token=true").model
    assert parameter_counts(m, VOCAB)[0] == TOTAL + 47 * 64


def test_the_dry_run_counts_the_whole_model_and_one_rank():
    from recipes.dry_run import rank_sizes, report

    cfg = make_cfg(*LLAVA, "parallelism=tp2", "gtp=tp2_align16")
    parallel_dims = validate(cfg, 4)
    sizes = rank_sizes(cfg, parallel_dims, 257)
    assert (sizes.total_parameters, sizes.parameters) == (TOTAL, PER_RANK_TP2_G2)
    assert PER_RANK_TP2_G2 == 81_504  # what train.py prints for the built model at this layout
    assert "248,640" in report(cfg, parallel_dims).replace("\u202f", ",")


def test_every_vision_and_projector_weight_is_a_gtp_weight_with_its_tp_local_rows():
    cfg = make_cfg(*LLAVA, "parallelism=tp2", "gtp=tp2_align16")
    dims = gtp_weight_dims(cfg, 2)
    vit = {f"vision_model.decoder.layers.{i}.{name}": rows for i in range(2)
           for name, rows in (("self_attention.linear_qkv.weight", 108),
                              ("self_attention.linear_proj.weight", 72),
                              ("mlp.linear_fc1.weight", 100), ("mlp.linear_fc2.weight", 72))}
    lm = {f"language_model.decoder.layers.{i}.{name}": rows for i in range(2)
          for name, rows in (("self_attention.linear_qkv.weight", 64),
                             ("self_attention.linear_proj.weight", 64),
                             ("mlp.linear_fc1.weight", 128), ("mlp.linear_fc2.weight", 64))}
    assert dims == {**vit, **lm, "language_model.embedding.word_embeddings.weight": 160,
                    "language_model.output_layer.weight": 160,
                    "vision_projection.encoder.linear_fc1.weight": 64,
                    "vision_projection.encoder.linear_fc2.weight": 64}
    assert len(dims) == 20  # megatron's count on the built model (the probe's, and after_model)


def test_the_two_vision_cases_of_the_seed():
    shapes = {p.name: p for p in parameter_shapes(make_cfg(*LLAVA).model, VOCAB)}
    fc1 = shapes["vision_model.decoder.layers.0.mlp.linear_fc1.weight"]
    # tp1, g2/a16: 200 rows pad by 24 to two shards of 112.
    assert local_shape(fc1, 1, 2, 16) == ((112, 72), 24)
    for name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        p = shapes[f"vision_model.decoder.layers.1.{name}"]
        # tp1, g4/a32: 72 rows pad to 128 in shards of 32; GTP rank 3 starts at row 96 > 72.
        assert local_shape(p, 1, 4, 32)[0][0] == 32
        assert gtp_padding(72, 4, 32) == (56, 32) and 3 * 32 >= 72


@pytest.mark.parametrize("overrides,match", [
    (["parallelism=pp2"], r"pipeline_model_parallel_size=2: megatron-core 0.19.2's LLaVAModel"),
    (["parallelism=tp2", "parallelism.context_parallel_size=2"],
     r"context_parallel_size=2: .*TransformerEngine's attention"),
    (["parallelism=tp2", "parallelism.sequence_parallel=true"], "sequence_parallel=true"),
    (["model.num_moe_experts=4"], "model.num_moe_experts=4 is a field of the 'moe' family, not "
                                  "of model.family='llava'"),
    (["model.mtp_num_layers=1"], "mtp_num_layers=1: LLaVAModel's language model"),
    (["model.transformer_impl=transformer_engine"], "builds megatron's local layers"),
    (["optim=muon"], "optim.optimizer='muon': only Adam"),
    (["logger.grad_norm_detail=true"], "grad_norm_detail=true"),
    (["model.vision_model_type=siglip"], r"vision_model_type='siglip': valid are \('clip',\)"),
    (["model.vision_projection_type=affine"],
     r"vision_projection_type='affine': valid are \('mlp',\)"),
    (["model.img_h=36"], "model.img_h=36 must be a multiple of model.patch_dim=8"),
    (["model.vision_num_attention_heads=5"],
     "vision_hidden_size=72 must be divisible by model.vision_num_attention_heads=5"),
    (["parallelism=tp4", "model.vision_num_attention_heads=6"],
     r"vision_num_attention_heads=6 must be divisible by tensor_model_parallel_size=4 .* "
     r"\[1, 2, 3, 6\]"),
    (["parallelism=tp4", "model.vision_ffn_hidden_size=202"],
     "vision_ffn_hidden_size=202 must be divisible by tensor_model_parallel_size=4"),
    (["model.vision_hidden_size=0"], "model.vision_hidden_size=0 is invalid"),
    (["data=pydoc"], r"data.source='pydoc' with model.vision_model_type='clip': .* data=shapes"),
])
def test_what_the_family_does_not_run_is_refused_before_launch(overrides, match):
    cfg = make_cfg(*LLAVA, *overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, cfg.parallelism.nproc_per_node)


def test_image_data_for_a_text_model_is_refused():
    cfg = make_cfg("model=tiny", "data=shapes")
    with pytest.raises(ConfigError, match=r"data.source='shapes' .* needs a vision-language"):
        validate(cfg, cfg.parallelism.nproc_per_node)


def test_llava_tiny_validates_at_the_tested_layouts():
    for overrides, world in ((["parallelism=tp2", "gtp=tp2_align16"], 4), (["parallelism=tp1"], 1),
                             (["parallelism=dp2"], 2), (["gtp=tp4_align32", "parallelism=tp1"], 4),
                             (["parallelism=tp2", "gtp=tp2_align16", "precision=bf16",
                               "optim.use_distributed_optimizer=true"], 4)):
        validate(make_cfg(*LLAVA, *overrides), world)


def test_a_llava_checkpoint_is_not_exported_and_the_reason_is_named():
    m = dict(make_cfg(*LLAVA).model)
    with pytest.raises(ExportError, match=r"model.vision_model_type='clip': a vision-language "
                                          r"\(LLaVA\) checkpoint is not exported"):
        for_export(m)
    m.update(family="gpt", vision_model_type=None)  # its language model alone is a Llama
    assert for_export(m).hf_class == "LlamaForCausalLM"


def test_image_caption_samples_mask_the_loss_to_the_caption():
    from megatron.core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX

    from recipes.data import ByteTokenizer
    from recipes.data.images import IMAGE_TOKEN_INDEX, ShapesDataset

    assert IMAGE_TOKEN_INDEX == DEFAULT_IMAGE_TOKEN_INDEX
    data = ShapesDataset(ByteTokenizer(), 50, 32, 32, 32, seed=1234)
    s = data[7]
    caption = s["caption"]
    n = len(caption)
    want = [-200, 10, *caption.encode(), 256] + [256] * (32 - n - 3)
    assert s["tokens"].tolist() == want
    assert s["labels"].tolist() == want[1:] + [256]
    # Positions 1 .. n + 1 predict the caption's bytes and the closing eod; nothing else counts.
    assert s["loss_mask"].tolist() == [0.0] + [1.0] * (n + 1) + [0.0] * (32 - n - 2)
    assert [s["labels"][j].item() for j in range(32) if s["loss_mask"][j]] == \
        [*caption.encode(), 256]
    again = ShapesDataset(ByteTokenizer(), 50, 32, 32, 32, seed=1234)[7]
    assert torch.equal(again["images"], s["images"]) and again["caption"] == caption
    other = ShapesDataset(ByteTokenizer(), 50, 32, 32, 32, seed=1234, split="validation")
    assert [other[i]["caption"] for i in range(8)] != [data[i]["caption"] for i in range(8)]
    assert len({data[i]["caption"] for i in range(50)}) > 10


def test_an_image_shows_the_shape_its_caption_names():
    from recipes.data.images import draw

    img = draw("square", "red", "big", (0.5, 0.5), 10, 10)  # half-width 0.4: pixels 1 .. 8
    assert img.shape == (3, 10, 10) and img.dtype == torch.float32
    inside = torch.zeros(10, 10, dtype=torch.bool)
    inside[1:9, 1:9] = True
    assert torch.equal(img[0][inside], torch.full((64,), 1.0))
    assert torch.allclose(img[1][inside], torch.full((64,), -0.8))
    assert torch.equal(img[:, ~inside], torch.full((3, 36), -1.0))
    cross = draw("cross", "white", "big", (0.5, 0.5), 10, 10)
    assert cross[0, 0, 5] == -1.0 and cross[0, 5, 5] == 1.0 and cross[0, 2, 2] == -1.0


def test_the_stock_reader_gets_each_sub_models_dims_from_the_run_config():
    """``ckpt.stock``'s dims per key prefix (the LLaVA family's ``sub_model_dims``), by hand from
    conf/model/llava_tiny.yaml: the Llama-style language model, the CLIP ViT (every head its
    own key/value, GeLU), the projector 72 -> 128 -> 64 (GeLU)."""
    from omegaconf import OmegaConf

    from ckpt.families import sub_model_dims

    m = OmegaConf.to_container(make_cfg(*LLAVA).model)
    keys = ["language_model.output_layer.weight", "vision_model.conv1.weight",
            "vision_projection.encoder.linear_fc1.weight"]
    assert sub_model_dims(keys, m) == {
        "language_model.": {"hidden_size": 64, "ffn_hidden_size": 128, "swiglu": True,
                            "num_attention_heads": 4, "num_query_groups": 2},
        "vision_model.": {"hidden_size": 72, "ffn_hidden_size": 200, "swiglu": False,
                          "num_attention_heads": 4, "num_query_groups": 4},
        "vision_projection.": {"hidden_size": 64, "ffn_hidden_size": 128, "swiglu": False}}
    # a text-only checkpoint has no sub-models; nothing recorded leaves their dims to the tensors
    assert sub_model_dims(["decoder.final_layernorm.weight"], m) == {}
    assert sub_model_dims(keys[1:], None) == {"vision_model.": {}, "vision_projection.": {}}


def test_a_text_length_too_short_for_a_caption_is_refused_before_launch():
    """The longest caption, "small magenta triangle", is 22 byte tokens: with the image token,
    the prompt and eod a sample needs 25 text positions (the workers raised it, once a rank)."""
    from recipes.config.prelaunch import check_tokenizer

    with pytest.raises(ConfigError, match=r"^model.seq_length=24 holds no whole caption: .* up "
                                          r"to 22 caption tokens and eod need "
                                          r"model.seq_length >= 25$"):
        check_tokenizer(make_cfg(*LLAVA, "model.seq_length=24"))
    check_tokenizer(make_cfg(*LLAVA, "model.seq_length=25"))


@pytest.mark.parametrize("saved_model, resumed, names", [
    # a LLaVA checkpoint resumed as a text model, and the other way round
    (["model=llava_tiny"], ["model=llama_tiny"], ["model.vision_model_type=None (checkpoint: 'clip')"]),
    (["model=llama_tiny"], ["model=llava_tiny", "data=shapes"],
     ["model.vision_model_type='clip' (checkpoint: None)"]),
    # one vision field changed on a LLaVA resume
    (["model=llava_tiny"], ["model=llava_tiny", "model.vision_ffn_hidden_size=256"],
     ["model.vision_ffn_hidden_size=256 (checkpoint: 200)"]),
    (["model=llava_tiny"], ["model=llava_tiny", "model.patch_dim=4"],
     ["model.patch_dim=4 (checkpoint: 8)"]),
])
def test_a_resume_into_another_model_kind_or_vision_shape_names_the_field(saved_model, resumed,
                                                                         names):
    """The refusal names the model kind (``vision_model_type``) and the vision field that
    changed, with the checkpoint's value (it named only the language model's fields, or
    parameters)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ckpt.io import CheckpointError
    from recipes.config.prelaunch import check_model_shape

    saved = OmegaConf.to_container(make_cfg(*saved_model).model, resolve=True)
    cfg = make_cfg(*resumed, "checkpoint.load=/tmp/unused")
    plan = SimpleNamespace(path="CKPT", common={"train_state": {"config": {"model": saved}}})
    with pytest.raises(CheckpointError) as info:
        check_model_shape(cfg, plan)
    for name in names:
        assert name in str(info.value), str(info.value)


def test_a_text_checkpoint_recorded_before_the_vision_fields_is_a_text_model():
    """A record without ``vision_model_type`` (written before the field) is a text model."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ckpt.io import CheckpointError
    from recipes.config.prelaunch import check_model_shape

    saved = OmegaConf.to_container(make_cfg("model=llama_tiny").model, resolve=True)
    saved = {k: v for k, v in saved.items() if not k.startswith(("vision_", "img_", "patch_"))}
    cfg = make_cfg("model=llava_tiny", "data=shapes", "checkpoint.load=/tmp/unused")
    plan = SimpleNamespace(path="CKPT", common={"train_state": {"config": {"model": saved}}})
    with pytest.raises(CheckpointError, match=r"model.vision_model_type='clip' \(checkpoint: None\)"):
        check_model_shape(cfg, plan)
