"""``python -m gtp import`` / ``export`` of a tiny ``Qwen3NextForCausalLM`` (GatedDeltaNet and
gated-attention layers, MoE with a gated shared expert and one dense MLP layer, zero-centred
norms, RoPE over half of each head), built and saved by ``transformers`` (the golden: nothing
of gtp/ or recipes/ makes it): import and export back bit for bit with the same config; the
Hub's multi-token prediction weights (``mtp.*``) left out and recorded; megatron's logits at
g2/a16 x ep2 (world 2) equal transformers' within the fp32 bound
(tests/helpers/tolerance.py); what cannot be mapped refused by field name, nothing written.

The norms are drawn away from their identity (zero-centred ones away from 0, GatedDeltaNet's
gated norm away from 1), the attention weights ten times transformers' init (peaked attention:
RoPE shows), ``A_log`` and ``dt_bias`` apart per head, so that a misplaced tensor or row shows.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt import cli
from hf_checks import assert_import_refused, dir_tensors, logits_world
from tolerance import fp32_rtol

VOCAB = 257  # the byte tokenizer's
SEQ = 64


def qwen3_next_config():
    """The tiny ``Qwen3NextConfig``: layers G, *, G, * (the third's MLP dense), 4 attention
    heads of 12 in 2 groups (gate rows), GatedDeltaNet 2 key heads of 8, 4 value heads of 6."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, intermediate_size=40, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=SEQ,
        layer_types=["linear_attention", "full_attention"] * 2, mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-6, bos_token_id=256, eos_token_id=256)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import Qwen3NextForCausalLM

    root = tmp_path_factory.mktemp("hf_qwen3_next")
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(qwen3_next_config())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.2)  # w * x: away from 1
            elif "norm" in n:
                p.normal_(0.3, 0.2)  # (1 + w) * x: away from 0
            elif "self_attn" in n:
                p.mul_(10)  # peaked attention: positions (partial RoPE) show in the logits
            elif n.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(root / "src")
    # The Hub's checkpoints hold multi-token prediction weights that transformers ignores.
    tensors = load_file(root / "src" / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.ones(32, 64),
               "mtp.norm.weight": torch.ones(32)}, root / "src" / "model.safetensors",
              metadata={"format": "pt"})
    return root


def _config_facts(d) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    drop = ("transformers_version", "_name_or_path", "dtype", "torch_dtype",
            "initializer_range", "use_cache", "output_router_logits")
    return {k: v for k, v in cfg.items() if k not in drop}


def test_import_then_export_is_bit_equal(hf, tmp_path):
    from megatron.core import dist_checkpointing

    from ckpt.format.records import IMPORTED_KEY
    from ckpt.hf import hf_import

    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    assert cli.main(["import", str(hf / "src"), str(ckpt)]) == 0
    model = hf_import.implied_model(hf / "src")
    assert model["hybrid_layer_pattern"] == "GE*EG-*E" and model["num_layers"] == 8
    assert model["moe_shared_expert_gate"] and model["layernorm_zero_centered_gamma"]
    assert model["attention_output_gate"] and model["rotary_percent"] == 0.5
    common = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000000"))
    assert common[IMPORTED_KEY]["left_out"] == {"tensors": 2,
                                                "first": ["mtp.fc.weight", "mtp.norm.weight"]}
    assert cli.main(["export", str(ckpt), str(out)]) == 0
    src = {k: v for k, v in dir_tensors(hf / "src").items() if not k.startswith("mtp.")}
    back = dir_tensors(out)
    assert sorted(back) == sorted(src)
    for key, tensor in src.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert _config_facts(out) == _config_facts(hf / "src")


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu"}, r"config.json hidden_act='gelu': only 'silu'"),
    ({"attention_bias": True}, r"config.json attention_bias=True: .*only false"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2},
     r"config.json layer_types=.*'full_attention', 'linear_attention'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}},
     r"config.json rope_parameters.rope_type='yarn': only 'default'"),
    ({"num_experts_per_tok": 1}, r"config.json norm_topk_prob=True: top-1 routing"),
    ({"shared_expert_intermediate_size": 0}, r"config.json shared_expert_intermediate_size=0"),
    ({"linear_num_value_heads": 6},
     r"in_proj_qkvz.weight' has shape \(80, 32\), the config implies \(104, 32\)"),
])
def test_what_cannot_be_mapped_is_refused_by_name(hf, tmp_path, change, match):
    assert_import_refused(hf, "src", change, match, tmp_path, "ckpt")


def test_imported_logits_equal_transformers_at_gtp_and_expert_layouts(hf, tmp_path,
                                                                      data_cache):
    """megatron's logits of the imported model at g2/a16 x ep2 (world 2: the GTP weights padded,
    GatedDeltaNet's in_proj among them; two experts a rank) equal transformers' on the same
    tokens within the fp32 bound of one forward, relative to the logits' scale (measured 6.6e-7
    against 1.7e-5; a swapped beta/alpha gives 2.5e-2, norms not zero-centred 0.54). The
    transformers model loads the source dir, its mtp weights ignored."""
    from compose import make_cfg
    from multiproc import run_distributed
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from recipes.run import pretrained

    layouts = {"g2a16 ep2": ("gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
                             "parallelism.expert_model_parallel_size=2")}
    cfgs = {}
    for name, extra in layouts.items():
        cfg = make_cfg(f"checkpoint.pretrained={hf / 'src'}", "parallelism=tp1",
                       "parallelism.nproc_per_node=2", *extra, "logger=none",
                       "train.eval_iters=0", "optim.lr_warmup_iters=0")
        cfg.output_dir, cfg.data.cache_dir = str(tmp_path / name), str(data_cache)
        pretrained.apply_source(cfg, overrides=[])
        pretrained.prepare(cfg, True)
        cfgs[name] = OmegaConf.to_yaml(cfg)
    results = run_distributed(logits_world, 2, cfgs, VOCAB, SEQ, timeout=600)
    model = AutoModelForCausalLM.from_pretrained(hf / "src", trust_remote_code=False).eval()
    params = sum(p.numel() for p in model.parameters())
    for name in layouts:
        tokens, got = results[0][name]
        with torch.no_grad():
            expected = model(tokens).logits
        # One forward: fp32 rounding only, relative to the logits' scale.
        bound = fp32_rtol(1, params) * expected.abs().max().item()
        diff = (got[..., :VOCAB] - expected).abs().max().item()
        assert diff <= bound, (name, diff, bound)
