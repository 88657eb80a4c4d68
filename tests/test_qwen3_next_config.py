"""Qwen3-Next without processes: the 80B-A3B preset's parameter count against transformers'
``Qwen3NextForCausalLM`` built on the meta device and the published figures, its MTP layer
counted as megatron's MTP part ('/*E'), the tiny preset's GTP padding, and the 80B recipe's
dry run with GatedDeltaNet's activations."""

from __future__ import annotations

import pytest
import torch
from compose import make_cfg

from recipes.config.validate import ConfigError, validate
from recipes.families import parameter_counts, parameter_shapes

VOCAB = 151936  # a multiple of 128 (make_vocab_size_divisible_by): no padding rows
H = 2048
PUBLISHED = (79_674_391_296, 3_874_929_408)  # Qwen3NextForCausalLM's (total, active)


def _hf_config():
    from transformers import Qwen3NextConfig

    # Qwen3-Next-80B-A3B's published config.json (rope and max_position_embeddings size no
    # parameter; intermediate_size only sizes dense MLP layers, of which it has none)
    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=10_000_000, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], full_attention_interval=4, tie_word_embeddings=False,
        max_position_embeddings=262144)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config())


def _layer_sum(model, layer: int) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(f"model.layers.{layer}."))


def test_qwen3_next_80b_counts_what_transformers_builds(hf_model):
    """Every count equal, module by module: megatron's GatedDeltaNet ``in_proj`` is HF's
    ``in_proj_qkvz`` and ``in_proj_ba`` stacked, ``linear_qkv`` (gate rows included) HF's
    ``q_proj`` (query and gate), ``k_proj`` and ``v_proj``, ``shared_experts.gate_weight``
    ``[1, h]`` HF's ``shared_expert_gate`` ``Linear(h, 1)``. The one difference is not in the
    count: Qwen3-Next's RMSNorms but GatedDeltaNet's ``out_norm`` are zero-centred (weight
    init 0, ``x * (1 + w)``); megatron's local norm refuses ``layernorm_zero_centered_gamma``
    and computes ``x * w`` (init 1), the same shape and function with ``w`` shifted by 1."""
    config = hf_model.config
    total = sum(p.numel() for p in hf_model.parameters())
    experts = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    m = make_cfg("model=qwen3_next_80b_a3b").model
    assert parameter_counts(m, VOCAB) == (total, active) == PUBLISHED
    ours = {p.name: torch.Size(p.shape).numel() for p in parameter_shapes(m, VOCAB)}
    # HF layer i is megatron's sublayers 2i (the mixer and its norm) and 2i + 1 (the MoE block)
    for hf_layer, kind in ((0, "linear_attention"), (3, "full_attention")):
        assert config.layer_types[hf_layer] == kind
        ours_layer = sum(n for name, n in ours.items()
                         if name.startswith((f"decoder.layers.{2 * hf_layer}.",
                                             f"decoder.layers.{2 * hf_layer + 1}.")))
        assert ours_layer == _layer_sum(hf_model, hf_layer), kind
    # published: "80B in total and 3B activated", 79B without the embedding and output layer
    embeddings = 2 * VOCAB * H
    assert (round(total / 1e9), round((total - embeddings) / 1e9),
            round((active - embeddings) / 1e9)) == (80, 79, 3)


def test_its_mtp_layer_is_counted_as_transformers_builds_its_layer(hf_model):
    """Qwen3-Next's checkpoint adds one MTP layer (``mtp.*``, which transformers drops): ``fc``
    ``[h, 2h]`` over [embedding; hidden], the norms of both and its final norm, and one
    decoder layer of full attention with an MoE block (as HF layer 3), sharing the model's
    embedding and output layer: 1,650,471,424 parameters. In megatron's unified pattern it is
    the MTP part ``/*E`` with ``mtp_num_layers=1``; the table counts it exactly, its rows under
    ``mtp.layers.0``."""
    mtp = 2 * H * H + 3 * H + _layer_sum(hf_model, 3)
    assert mtp == 1_650_471_424
    pattern = make_cfg("model=qwen3_next_80b_a3b").model.hybrid_layer_pattern
    cfg = make_cfg("model=qwen3_next_80b_a3b", f"model.hybrid_layer_pattern='{pattern}/*E'",
                   "model.mtp_num_layers=1", "parallelism.expert_model_parallel_size=2")
    validate(cfg, 2)
    total, _ = parameter_counts(cfg.model, VOCAB)
    assert total == PUBLISHED[0] + mtp
    assert sum(torch.Size(p.shape).numel() for p in parameter_shapes(cfg.model, VOCAB)
               if p.name.startswith("mtp.layers.0.")) == mtp


def test_the_tiny_preset_is_qwen3_next_shaped_and_gtp_pads_it():
    from recipes.dry_run.sizes import stage_tensors

    cfg = make_cfg("model=qwen3_next_tiny", "parallelism=dp2", "parallelism.nproc_per_node=4",
                   "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16", "train.dry_run=true")
    m = cfg.model
    assert (m.hybrid_layer_pattern, m.attention_output_gate, m.qk_layernorm, m.swiglu,
            m.moe_router_score_function, m.moe_shared_expert_gate) == (
        "GEGE*E", True, True, True, "softmax", True)
    assert parameter_counts(m, 320)[0] == 142_304
    from recipes.config.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(cfg, 4)
    local = {t.name: t for t in stage_tensors(cfg, dims, 320)}
    in_proj = local["decoder.layers.0.self_attention.in_proj.weight"]
    # 120 rows of 48 padded to 128 over g2: 64 a rank, the 8 padding rows the dry run's count
    assert (in_proj.elements, in_proj.stored) == (64 * 48, (64 - 8) * 48)


def test_the_80b_recipe_fits_with_gated_delta_net_activations(monkeypatch):
    from recipes.config import prelaunch
    from recipes.dry_run import report
    from recipes.dry_run.sizes import _hybrid_sublayers
    from recipes.model import te

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    name = "qwen3_next_80b_a3b_pp4_ep16_bf16"
    cfg = make_cfg(f"experiment={name}", "train.dry_run=true")
    out = report(cfg, prelaunch.check(cfg, choices={"experiment": name}))
    assert "fits train.gpu_memory_gib=" in out and "does not fit" not in out, out
    # the published count plus the MTP layer
    # (test_its_mtp_layer_is_counted_as_transformers_builds_its_layer)
    assert "81,324,862,720 parameters" in out and "1 MTP layer included" in out, out
    assert "ep16 x etp1 x egtp2" in out, out
    # per s b h, by hand from the published sizes (h 2048): a GatedDeltaNet sublayer 5 + (2 x
    # in_proj 12352 + 2 x conv 8192 + 4 x qk 2048 + 6 x 32 heads + 4 x 32 x 64 (A) + 4 x v
    # 4096) / 2048; gated attention 5 + 4 (16 + 2) 256 / 2048 + 4 x 16 x 256 / 2048; an MoE
    # block 5 + 10 (2 + 4 x 512 / 2048) + 4 x 512 / 2048; twelve of GEGEGE*E.
    gdn = 5 + (2 * 12352 + 2 * 8192 + 4 * 2048 + 6 * 32 + 4 * 32 * 64 + 4 * 4096) / 2048
    block = 3 * gdn + (5 + 9 + 8) + 4 * (5 + 10 * 3 + 1)
    main, mtp = cfg.model.hybrid_layer_pattern.split("/")  # the recipe trains the MTP layer
    assert _hybrid_sublayers(cfg.model, 1, 1, main) == (pytest.approx(12 * block), 12)
    assert (mtp, cfg.model.mtp_num_layers) == ("*E", 1)


def test_a_shared_expert_gate_without_a_shared_expert_is_refused():
    cfg = make_cfg("model=qwen3_next_tiny", "model.moe_shared_expert_intermediate_size=null",
                   "parallelism=dp2")
    with pytest.raises(ConfigError, match="model.moe_shared_expert_gate=true without a shared "
                                          "expert"):
        validate(cfg, 2)
