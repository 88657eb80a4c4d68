"""``python -m gtp import`` / ``export`` of DeepSeek-style MoE models: a tiny
``DeepseekV3ForCausalLM`` (multi-latent attention with YaRN, a dense first layer, a shared
expert, sigmoid routing with the expert bias, top-2 of 1 of 2 groups, scaled by 2.5) and a tiny
``Glm4MoeForCausalLM`` (q/k/v biases, q/k norms, RoPE over half of each head, the same MoE),
built and saved by ``transformers`` (the goldens: nothing of gtp/ or recipes/ makes them),
import and export back bit for bit with the same config; megatron's logits of both at ep2 x
expert GTP 2 (world 4; the experts' rows padded) equal transformers' within 1e-4.

Norm weights are drawn away from 1, the expert biases away from 0 (they change which experts
are chosen) and the attention weights ten times transformers' init (attention far from uniform,
so that RoPE and YaRN show in the logits) so that a misplaced tensor or position shows.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckpt import cli
from hf_checks import assert_same_tensors, logits_world

VOCAB = 257  # the byte tokenizer's
SEQ = 64
NAMES = ("deepseek_v3", "glm4_moe")


def _save_models(root):
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig,
                              Glm4MoeForCausalLM)

    torch.manual_seed(0)
    dims = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=12, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=256, eos_token_id=256)
    models = {
        "deepseek_v3": DeepseekV3ForCausalLM(DeepseekV3Config(
            **dims, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
        "glm4_moe": Glm4MoeForCausalLM(Glm4MoeConfig(
            **dims, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5})),
    }
    with torch.no_grad():
        for name, model in models.items():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.5, 0.1)  # away from 1: a misplaced tensor shows
                elif "self_attn" in n:
                    p.mul_(10)  # peaked attention: positions (RoPE, YaRN) show in the logits
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.3)  # away from 0: the choice of experts depends on it
            model.save_pretrained(root / name)


def _config_facts(config) -> dict:
    d = json.loads((config / "config.json").read_text())
    drop = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype",
            "initializer_range", "use_cache", "output_router_logits", "num_nextn_predict_layers",
            "pretraining_tp", "topk_method")
    return {k: v for k, v in d.items() if k not in drop}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    _save_models(root)
    return root


@pytest.mark.parametrize("name", NAMES)
def test_import_then_export_is_bit_equal(hf, tmp_path, name):
    from ckpt.hf import hf_import

    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    assert cli.main(["import", str(hf / name), str(ckpt)]) == 0
    model = hf_import.implied_model(hf / name)
    assert model["moe_layer_freq"] == [0, 1, 1] and model["moe_router_enable_expert_bias"]
    assert model.get("multi_latent_attention", False) == (name == "deepseek_v3")
    assert cli.main(["export", str(ckpt), str(out)]) == 0
    assert_same_tensors(hf / name, out)
    assert _config_facts(out) == _config_facts(hf / name)


def test_imported_logits_equal_transformers_at_ep2_expert_gtp2(hf, tmp_path, data_cache):
    """megatron's logits of each imported model at ep2 x expert GTP 2 (world 4) equal
    transformers' on the same tokens within 1e-4 (fp32; one forward, no reduction over ranks
    but the experts' alltoall): multi-latent attention and YaRN, the dense first layer, the
    sigmoid routing with the expert bias and groups, the shared expert, GLM's partial RoPE and
    biases, every tensor in place."""
    from compose import make_cfg
    from multiproc import run_distributed
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from recipes.run import pretrained

    cfgs = {}
    for name in NAMES:
        cfg = make_cfg(f"checkpoint.pretrained={hf / name}", "parallelism=tp1",
                       "parallelism.nproc_per_node=4", "parallelism.expert_model_parallel_size=2",
                       "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16",
                       "logger=none", "train.eval_iters=0", "optim.lr_warmup_iters=0")
        cfg.output_dir, cfg.data.cache_dir = str(tmp_path / name), str(data_cache)
        pretrained.apply_source(cfg, overrides=[])
        pretrained.prepare(cfg, True)
        cfgs[name] = OmegaConf.to_yaml(cfg)
    results = run_distributed(logits_world, 4, cfgs, VOCAB, SEQ, timeout=600)
    for name in NAMES:
        tokens, got = results[0][name]
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(
                hf / name, trust_remote_code=False).eval()(tokens).logits
        diff = (got[..., :VOCAB] - expected).abs().max().item()
        assert diff <= 1e-4, (name, diff)
