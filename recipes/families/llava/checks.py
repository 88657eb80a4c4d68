"""The LLaVA family's rules, before any process starts (``recipes.config.validate``)."""

from __future__ import annotations

from recipes.config.errors import ConfigError
from recipes.families.llava.model import PROJECTION_TYPES, VISION_MODEL_TYPES
from recipes.config.parallel_dims import check_positive

# The data source that gives images with captions (recipes.data.images).
IMAGE_SOURCE = "shapes"


def check(cfg, parallel_dims) -> None:
    """What a LLaVA ``model`` needs of itself and of the run.

    Raises:
        ConfigError: a ``vision_model_type`` other than ``clip`` or a projector other than
            ``mlp``; ViT or projector sizes < 1, image sides that ``patch_dim`` does not divide,
            ViT heads that do not divide its hidden size, ViT heads, ffn or projector width
            that tensor parallelism cannot split; text too short for the image token and one
            caption token; data without images (``data.source`` other than ``shapes``); and
            what is not run here, each named with the reason: pipeline (and virtual pipeline),
            context or sequence parallelism, multi-token prediction, gated attention
            (``attention_output_gate``), TransformerEngine
            layers, Muon, a
            Hugging Face ``checkpoint.pretrained``, ``logger.grad_norm_detail``.
    """
    m, tp = cfg.model, parallel_dims.tensor_model_parallel_size
    key = f"model.vision_model_type={m.vision_model_type!r}"
    if m.vision_model_type not in VISION_MODEL_TYPES:
        raise ConfigError(f"{key}: valid are {VISION_MODEL_TYPES} (megatron's CLIP ViT; "
                          f"SigLIP, InternViT and RADIO are not run here)")
    if m.vision_projection_type not in PROJECTION_TYPES:
        raise ConfigError(f"model.vision_projection_type={m.vision_projection_type!r}: valid are "
                          f"{PROJECTION_TYPES}")
    _check_sizes(m, tp)
    if cfg.data.source != IMAGE_SOURCE:
        raise ConfigError(f"data.source={cfg.data.source!r} with {key}: a vision-language model "
                          f"trains on images with captions; use data={IMAGE_SOURCE}")
    _check_run(cfg, parallel_dims, key)


def _check_sizes(m, tp: int) -> None:
    for name in ("vision_num_layers", "vision_hidden_size", "vision_num_attention_heads",
                 "vision_ffn_hidden_size", "vision_projection_ffn_hidden_size", "img_h", "img_w",
                 "patch_dim"):
        check_positive(f"model.{name}", m[name])
    for side in ("img_h", "img_w"):
        if m[side] % m.patch_dim:
            raise ConfigError(f"model.{side}={m[side]} must be a multiple of model.patch_dim="
                              f"{m.patch_dim} (the ViT cuts the image into whole patches)")
    if m.vision_hidden_size % m.vision_num_attention_heads:
        raise ConfigError(f"model.vision_hidden_size={m.vision_hidden_size} must be divisible "
                          f"by model.vision_num_attention_heads={m.vision_num_attention_heads}")
    for name in ("vision_num_attention_heads", "vision_ffn_hidden_size",
                 "vision_projection_ffn_hidden_size"):
        if m[name] % tp:
            raise ConfigError(f"model.{name}={m[name]} must be divisible by "
                              f"tensor_model_parallel_size={tp} (megatron splits it over the "
                              f"TP ranks); valid tensor_model_parallel_size values: "
                              f"{[d for d in range(1, m[name] + 1) if m[name] % d == 0]}")
    if m.seq_length < 3:
        raise ConfigError(f"model.seq_length={m.seq_length}: a sample is the image token, a "
                          f"prompt token and at least one caption token (>= 3)")


def _check_run(cfg, parallel_dims, key: str) -> None:
    m = cfg.model
    refusals = (
        (parallel_dims.pipeline_model_parallel_size > 1,
         f"parallelism.pipeline_model_parallel_size={parallel_dims.pipeline_model_parallel_size}: "
         f"megatron-core 0.19.2's LLaVAModel puts the ViT and projector on the first stage and "
         f"pipelines only the language model, with a fixed-length padded sequence that this "
         f"family's schedule and parameter plan do not handle; use 1"),
        (bool(parallel_dims.virtual_pipeline_model_parallel_size),
         f"parallelism.virtual_pipeline_model_parallel_size="
         f"{parallel_dims.virtual_pipeline_model_parallel_size}: no pipeline stages here; "
         "use null"),
        (parallel_dims.context_parallel_size > 1,
         f"parallelism.context_parallel_size={parallel_dims.context_parallel_size}: megatron-core "
         f"0.19.2's LLaVAModel needs TransformerEngine's attention for it; use 1"),
        (parallel_dims.sequence_parallel,
         "parallelism.sequence_parallel=true: megatron-core 0.19.2's LLaVAModel needs "
         "TransformerEngine's attention for it; use false"),
        (bool(m.get("mtp_num_layers")), f"model.mtp_num_layers={m.get('mtp_num_layers')}: "
         f"LLaVAModel's language model is built without MTP layers; use null"),
        (bool(m.get("attention_output_gate", False)),
         "model.attention_output_gate=true: the family's stock-format dims of the language "
         "model know no gate rows in linear_qkv (gated attention is run by the gpt, moe and "
         "hybrid families); use false"),
        (m.get("transformer_impl") == "transformer_engine",
         "model.transformer_impl='transformer_engine': the family builds megatron's local "
         "layers (their weights are its parameter table); use 'local' or null"),
        (cfg.optim.get("optimizer", "adam") != "adam",
         f"optim.optimizer={cfg.optim.get('optimizer')!r}: only Adam is run with a LLaVA model "
         f"here (Muon's per-layer layouts read a GPT decoder); use adam"),
        (bool(cfg.checkpoint.get("pretrained")),
         "checkpoint.pretrained: no Hugging Face LLaVA import here; start from scratch or "
         "resume with checkpoint.load"),
        (bool(cfg.logger.get("grad_norm_detail", False)),
         "logger.grad_norm_detail=true: the per-layer norms read a GPT decoder's layers; use "
         "false"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")
