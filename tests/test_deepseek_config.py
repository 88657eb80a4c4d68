"""DeepSeek-V3 without processes: the 671B preset's parameter count against transformers'
``DeepseekV3ForCausalLM`` built on the meta device and the published figures (with and without
the MTP module), and the 671B recipe's dry run with multi-latent attention's activations."""

from __future__ import annotations

import math

import pytest
import torch
from compose import make_cfg

from recipes.families import parameter_counts, parameter_shapes

VOCAB = 129280  # a multiple of 128 (make_vocab_size_divisible_by): no padding rows
PUBLISHED = (671_026_404_352, 37_552_282_624)  # DeepseekV3ForCausalLM's (total, active)


def _hf_config():
    from transformers import DeepseekV3Config

    # DeepSeek-V3's published config.json (rope_scaling does not size a parameter)
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        tie_word_embeddings=False)


def test_deepseek_v3_counts_what_transformers_builds():
    from transformers import AutoModelForCausalLM

    config = _hf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.n_routed_experts
    ours = parameter_counts(make_cfg("model=deepseek_v3").model, VOCAB)
    assert ours == (total, active) == PUBLISHED


def test_deepseek_v3_with_its_mtp_module_is_the_published_685b():
    """The Hub's safetensors hold 684,531,386,000 numbers ("685B"): the model with its MTP
    module, the MTP module's own copies of the embedding and output head (layer 61; megatron's
    MTP layer shares the model's), the 59 MoE layers' expert biases (buffers, not parameters)
    and the FP8 weights' block scales, one per 128 x 128 block of every linear weight but the
    routers, embeddings, output head and MTP's eh_proj (kept in bf16)."""
    m = make_cfg("model=deepseek_v3", "model.mtp_num_layers=1").model
    total, _ = parameter_counts(m, VOCAB)
    shapes = {p.name: p.shape for p in parameter_shapes(m, VOCAB)}
    mtp = sum(torch.Size(s).numel() for n, s in shapes.items() if n.startswith("mtp."))
    assert total == PUBLISHED[0] + mtp
    assert shapes["mtp.layers.0.eh_proj.weight"] == (7168, 2 * 7168)
    assert "mtp.layers.0.mtp_model_layer.mlp.router.weight" in shapes  # an MoE layer
    copies = 2 * VOCAB * 7168
    scales = sum(math.ceil(s[0] / 128) * math.ceil(s[1] / 128) for n, s in shapes.items()
                 if len(s) == 2 and not any(k in n for k in ("embedding", "output_layer",
                                                              "router", "eh_proj")))
    biases = (58 + 1) * 256
    assert total + copies + biases + scales == 684_531_386_000


def test_the_671b_recipe_fits_with_mla_activations(monkeypatch):
    from recipes.config import prelaunch
    from recipes.dry_run.sizes import _attention_terms
    from recipes.model import te
    from recipes.dry_run import report

    # the GPUs the recipe is written for, TransformerEngine importable: still valid (MLA's
    # local layers)
    monkeypatch.setattr(te, "transformer_engine_usable", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for extra in ([], ["model.mtp_num_layers=1"]):
        name = "deepseek_v3_671b_tp8_ep64_bf16"
        cfg = make_cfg(f"experiment={name}", "train.dry_run=true", *extra)
        out = report(cfg, prelaunch.check(cfg, choices={"experiment": name}))
        assert "fits train.gpu_memory_gib=" in out and "does not fit" not in out, out
    # Q and K of 128 heads x (128 + 64) dims and V of 128 x 128, over the hidden size 7168;
    # the latents 4 x 1536 + 4 x 512 and the rope key 2 x 64.
    split, extra = _attention_terms(make_cfg("model=deepseek_v3").model)
    assert split == pytest.approx((4 * 128 * 192 + 4 * 128 * 128) / 7168)
    assert extra == pytest.approx((4 * 1536 + 4 * 512 + 2 * 64) / 7168)
    assert _attention_terms(make_cfg("model=llama_tiny").model) == (8.0, 0.0)
