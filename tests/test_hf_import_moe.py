"""``python -m gtp import`` of Mixture-of-Experts models: a tiny ``MixtralForCausalLM`` and a
tiny ``Qwen3MoeForCausalLM`` built and saved by ``transformers`` (the goldens: nothing of gtp/ or
recipes/ makes them; 2 layers, 4 experts, top-2, GQA 4 heads / 2 groups) import and export back
bit for bit, with the same config; settings megatron-core 0.19.2 cannot express are refused,
named, before anything is written; megatron's logits of both, experts split over two
expert-parallel ranks (ep2, world 2), equal transformers' within 1e-4; and
``checkpoint.pretrained`` of the Mixtral trains one iteration at lr 0 at ep2 x expert
gtp2/a64 (padded expert rows), whose save exports to the source's tensors bit for bit.

The Qwen3-MoE has ``norm_topk_prob: false`` (megatron's ``moe_router_pre_softmax``), q/k norms
and a ``head_dim`` apart from hidden / heads; the Mixtral renormalises its top-k. Norm weights
are drawn away from 1 so that a misplaced tensor shows.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ckpt import cli
from hf_checks import assert_import_refused, assert_same_tensors, logits_world

VOCAB = 257  # the byte tokenizer's, so the recipes' data pipeline feeds the fine-tune
SEQ = 64
NAMES = ("mixtral", "qwen3_moe")


def _save_models(root):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    dims = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=SEQ,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                bos_token_id=256, eos_token_id=256)
    models = {
        "mixtral": MixtralForCausalLM(MixtralConfig(
            **dims, intermediate_size=48, num_local_experts=4, sliding_window=None)),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **dims, intermediate_size=64, moe_intermediate_size=24, num_experts=4, head_dim=16,
            norm_topk_prob=False)),
    }
    with torch.no_grad():
        for name, model in models.items():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.5, 0.1)  # away from 1: a misplaced tensor shows
            model.save_pretrained(root / name)


def _config_facts(config) -> dict:
    """What makes two transformers configs compute the same model."""
    d = json.loads((config / "config.json").read_text())
    drop = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype",
            "initializer_range", "use_cache", "output_router_logits")
    d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    return {k: v for k, v in d.items() if k not in drop}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    _save_models(root)
    return root


@pytest.mark.parametrize("name", NAMES)
def test_moe_import_then_export_is_bit_equal(hf, tmp_path, name):
    from ckpt.hf import hf_import

    ckpt, out = tmp_path / "ckpt", tmp_path / "exported"
    assert cli.main(["import", str(hf / name), str(ckpt)]) == 0
    model = hf_import.implied_model(hf / name)
    assert (model["num_moe_experts"], model["moe_router_topk"]) == (4, 2)
    assert model["moe_ffn_hidden_size"] == (48 if name == "mixtral" else 24)
    assert model["moe_router_pre_softmax"] == model["qk_layernorm"] == (name == "qwen3_moe")
    assert cli.main(["export", str(ckpt), str(out)]) == 0
    assert_same_tensors(hf / name, out)
    assert _config_facts(out) == _config_facts(hf / name)


def test_moe_refusals_name_the_field(hf, tmp_path):
    """What megatron-core 0.19.2 cannot express, refused before anything is written."""
    def refused(src: str, change: dict, match: str, out: str) -> None:
        assert_import_refused(hf, src, change, match, tmp_path, out)
        assert not (tmp_path / out).exists()

    refused("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2", "o1")
    refused("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]", "o2")
    refused("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True", "o3")
    refused("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True},
            "norm_topk_prob=True: top-1", "o4")
    refused("mixtral", {"sliding_window": 32}, "sliding_window=32", "o5")
    refused("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1", "o6")
    refused("mixtral", {"num_local_experts": 8}, r"num_local_experts=8: tensor .*gate\.weight",
            "o7")
    refused("mixtral", {"intermediate_size": 40}, r"intermediate_size=40: tensor .*experts\.0\.w1",
            "o8")
    # DeepSeek-V3's routing and shared experts: named with megatron's field (not imported yet)
    refused("mixtral", {"scoring_func": "sigmoid"},
            "scoring_func='sigmoid': megatron's moe_router_score_function", "o9")
    refused("qwen3_moe", {"topk_method": "noaux_tc"},
            "topk_method='noaux_tc': megatron's moe_router_enable_expert_bias", "o10")
    refused("mixtral", {"n_group": 2}, "n_group=2: megatron's moe_router_num_groups", "o11")
    refused("mixtral", {"routed_scaling_factor": 2.5},
            "routed_scaling_factor=2.5: megatron's moe_router_topk_scaling_factor", "o12")
    refused("qwen3_moe", {"shared_expert_intermediate_size": 32},
            "shared_expert_intermediate_size=32: shared experts .megatron's "
            "moe_shared_expert_intermediate_size.", "o13")


def test_moe_pretrained_at_ep2_egtp2_a64_exports_the_source(hf, tmp_path, train_jobs):
    """``checkpoint.pretrained=MIXTRAL_DIR`` at ep2 x expert gtp2/a64 (world 4, each rank half
    of two of the four experts' rows; fc1's 96 rows and fc2's 32 are padded to 128), lr 0, one
    iteration: the save exports to the source's tensors bit for bit."""
    out = tmp_path / "job"
    done = train_jobs([(out, [f"checkpoint.pretrained={hf / 'mixtral'}", "parallelism=tp1",
                       "parallelism.nproc_per_node=4", "parallelism.expert_model_parallel_size=2",
                       "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=64",
                       "optim.lr=0", "optim.min_lr=0", "train.train_iters=1",
                       "optim.lr_warmup_iters=0", "train.eval_iters=0",
                       "checkpoint.save=" + str(out / "ckpt")])])
    stdout = done[0].stdout
    assert "imported" in stdout and "experts ep2" in stdout, stdout[-3000:]
    exported = tmp_path / "exported"
    assert cli.main(["export", str(out / "ckpt"), str(exported)]) == 0
    assert_same_tensors(hf / "mixtral", exported)


def test_a_preset_that_contradicts_the_source_is_refused_naming_each_field(hf):
    """``model=moe_tiny`` with a Qwen3-MoE source: the preset's q/k norms (none), head width and
    routing (renormalised top-k) would load the source's tensors into another model, or drop
    some: refused before launch, each field named with both values."""
    from compose import make_cfg

    from recipes.run import pretrained
    from recipes.config.errors import ConfigError

    overrides = ["model=moe_tiny", "model.hidden_size=32", "model.ffn_hidden_size=64",
                 "model.moe_ffn_hidden_size=24", "model.num_attention_heads=4",
                 "model.num_query_groups=2", "model.num_layers=2"]
    cfg = make_cfg(f"checkpoint.pretrained={hf / 'qwen3_moe'}", *overrides)
    with pytest.raises(ConfigError) as refused:
        pretrained.apply_source(cfg, overrides=overrides)
    message = str(refused.value)
    for field in ("model.qk_layernorm=False (the source has True)",
                  "model.kv_channels=None (the source has 16)",
                  "model.moe_router_pre_softmax=False (the source has True)"):
        assert field in message, message
    # A value the source's default stands for is no contradiction: kv_channels hidden / heads.
    cfg = make_cfg(f"checkpoint.pretrained={hf / 'mixtral'}", "model.kv_channels=8")
    pretrained.apply_source(cfg, overrides=["model.kv_channels=8"])
    assert cfg.model.kv_channels == 8 and not cfg.model.qk_layernorm
    # The default preset (model=tiny, not given) becomes the source's family with its fields.
    assert cfg.model.family == "moe" and cfg.model.num_moe_experts
    cfg = make_cfg(f"checkpoint.pretrained={hf / 'mixtral'}", "model.kv_channels=16")
    with pytest.raises(ConfigError, match=r"model.kv_channels=16 \(the source has None\)"):
        pretrained.apply_source(cfg, overrides=["model.kv_channels=16"])


def test_an_expert_count_the_weights_contradict_is_named_as_the_file_names_it(hf, tmp_path):
    """transformers >= 5 writes a Qwen3-MoE's expert count as ``num_local_experts``."""
    from ckpt.hf import hf_import

    bad = tmp_path / "qwen3_moe"
    shutil.copytree(hf / "qwen3_moe", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    with pytest.raises(hf_import.HFImportError, match=r"num_local_experts \(num_experts\)=8"):
        hf_import.import_hf(bad, tmp_path / "out")


def test_imported_moe_logits_equal_transformers(hf, tmp_path, data_cache):
    """megatron's logits of each imported model, its experts split over two expert-parallel
    ranks (ep2), equal transformers' on the same tokens within 1e-4: the routing (Mixtral's
    softmax over the top-k logits; Qwen3-MoE's softmax then top-k, not renormalised) and every
    expert, norm and attention tensor in place."""
    from compose import make_cfg
    from multiproc import run_distributed
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from recipes.run import pretrained

    cfgs = {}
    for name in NAMES:
        cfg = make_cfg(f"checkpoint.pretrained={hf / name}", "parallelism=tp1",
                       "parallelism.nproc_per_node=2", "parallelism.expert_model_parallel_size=2",
                       "logger=none", "train.eval_iters=0", "optim.lr_warmup_iters=0")
        cfg.output_dir, cfg.data.cache_dir = str(tmp_path / name), str(data_cache)
        pretrained.apply_source(cfg, overrides=[])
        pretrained.prepare(cfg, True)
        cfgs[name] = OmegaConf.to_yaml(cfg)
    results = run_distributed(logits_world, 2, cfgs, VOCAB, SEQ, timeout=600)
    for name in NAMES:
        tokens, got = results[0][name]
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(
                hf / name, trust_remote_code=False).eval()(tokens).logits
        diff = (got[..., :VOCAB] - expected).abs().max().item()
        assert diff <= 1e-4, (name, diff)
