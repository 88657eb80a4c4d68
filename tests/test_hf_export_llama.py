"""``python -m gtp export`` of a Llama-family megatron model (RMSNorm, no linear bias, SwiGLU,
RoPE, grouped-query attention) to ``LlamaForCausalLM``: the logits match megatron's.

The model is built here directly with megatron-core (the recipes' model config does not offer
RMSNorm/no-bias yet) and saved with dist_checkpointing plus the run-config record the export
reads. GPT models and the layouts are covered in tests/test_eval_export_layouts.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from multiproc import run_distributed

VOCAB = 257
MODEL = {"name": "llama_tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "ffn_hidden_size": 96, "seq_length": 32, "swiglu": True,
         "position_embedding_type": "rope", "normalization": "RMSNorm", "add_bias_linear": False,
         "share_embeddings_and_output_weights": False, "make_vocab_size_divisible_by": 64}


def _build_and_save(root: str):
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mcore_compat import cpu

    cpu.install()
    # megatron's RotaryEmbedding moves inv_freq to the current CUDA device; this test's process
    # has none (RoPE on CPU is not part of mcore_compat yet).
    torch.cuda.current_device = lambda: "cpu"
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.05)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=320, max_sequence_length=32, position_embedding_type="rope")
    with torch.no_grad():  # norm weights away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    state = {"model": model.sharded_state_dict(), "iteration": 1, "layout": {},
             "opt_param_scheduler": {},
             "train_state": {"config": {"model": MODEL, "data": {"tokenizer": "byte"}}},
             "vocab_size": VOCAB}
    path = f"{root}/iter_0000001"
    os.makedirs(path)
    dist_checkpointing.save(state, path)
    with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("1")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(32).unsqueeze(0).expand_as(tokens), None)
    parallel_state.destroy_model_parallel()
    return tokens, logits


def _another_model(out: Path) -> Path:
    """A dir holding another (sharded) export."""
    out.mkdir()
    (out / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (out / "gtp_recipes_export.json").write_text('{"source": "/old/checkpoints/iter_0000007"}')
    (out / "model.safetensors.index.json").write_text("{}")
    for i in (1, 2):
        (out / f"model-0000{i}-of-00002.safetensors").write_bytes(b"old")
    return out


def test_export_refuses_a_dir_holding_another_model(tmp_path, capsys):
    """Before the checkpoint is read, naming what is there and --force; nothing written."""
    from ckpt import cli

    hf = _another_model(tmp_path / "hf")
    before = sorted((p.name, p.read_bytes()) for p in hf.iterdir())
    assert cli.main(["export", str(tmp_path / "no_such_checkpoint"), str(hf)]) == 2
    err = capsys.readouterr().err
    for part in (f"{hf} is not empty", "GPT2LMHeadModel", "exported from /old/checkpoints/"
                 "iter_0000007", "config.json, gtp_recipes_export.json", "pass --force"):
        assert part in err, err
    assert sorted((p.name, p.read_bytes()) for p in hf.iterdir()) == before
    (tmp_path / "file").write_text("x")
    assert cli.main(["export", str(tmp_path / "no_such_checkpoint"), str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_llama_export_logits_equal_megatron(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from ckpt import cli

    root = tmp_path / "ckpt"
    tokens, logits = run_distributed(_build_and_save, 1, str(root), timeout=300)[0]
    hf = _another_model(tmp_path / "hf")
    assert cli.main(["export", str(root), str(hf)]) == 2  # refused: another model is there
    assert (hf / "model-00002-of-00002.safetensors").read_bytes() == b"old"
    assert cli.main(["export", str(root), str(hf), "--force"]) == 0
    assert not (hf / "model-00002-of-00002.safetensors").exists()  # its stale shards are gone
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_key_value_heads == 2 and model.lm_head.weight.shape == (VOCAB, 64)
    with torch.no_grad():
        hf = model(tokens).logits
    diff = (hf - logits[..., :VOCAB]).abs().max().item()
    assert diff <= 1e-4, diff


def test_a_byte_tokenizer_export_writes_the_byte_tokenizer(tmp_path):
    """A run with ``data.tokenizer=byte`` exports a tokenizer that ``AutoTokenizer`` loads and
    that encodes and decodes as recipes' ByteTokenizer (id = UTF-8 byte, ``<eod>`` = 256, the
    text "<eod>" as its bytes), not nothing (AutoTokenizer then builds a useless one; issue 58
    item 6)."""
    from transformers import AutoTokenizer

    from ckpt.hf.hf_export import _copy_tokenizer
    from ckpt.hf.tokens import eod_of_tokenizer
    from recipes.data.tokenizers import ByteTokenizer

    ids = {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256}
    assert _copy_tokenizer({"tokenizer": "byte"}, tmp_path, ids) == [
        "tokenizer.json", "tokenizer_config.json"]
    hf, byte = AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer()
    assert len(hf) == 257 and hf.eos_token_id == hf.pad_token_id == 256
    for text in ["The Python ", " two  spaces\n\ttab", "héllo ✓ 日本語 🎉", "<eod>x", "\x00\x7f"]:
        got = hf(text, add_special_tokens=False)["input_ids"]
        assert got == [int(i) for i in byte.tokenize(text)], text
        assert hf.decode(got) == text
    assert hf.decode([104, 105, 0xFF, 256]) == byte.detokenize([104, 105, 0xFF]) + "<eod>"
    # the export as checkpoint.pretrained's tokenizer: its end of document is found
    assert eod_of_tokenizer(tmp_path / "tokenizer.json") == 256


def test_an_export_without_a_tokenizer_says_so_in_one_line(tmp_path, monkeypatch):
    """``data.tokenizer=external`` (or a tokenizer path that is gone): nothing to copy, and
    ``gtp export`` says so in one line instead of leaving AutoTokenizer to guess."""
    import argparse
    import io

    from ckpt import cli
    from ckpt.hf import hf_export

    assert hf_export._copy_tokenizer({"tokenizer": "external"}, tmp_path, {}) == []
    (tmp_path / "gtp_recipes_export.json").write_text(json.dumps({
        "architecture": "LlamaForCausalLM", "vocab_size": 300, "iteration": 2, "source": "/c",
        "tokenizer_files": []}))
    monkeypatch.setattr(hf_export, "export", lambda *a, **k: tmp_path)
    out = io.StringIO()
    cli.cmd_export(argparse.Namespace(ckpt="/c", out=str(tmp_path), layout=None, force=False), out)
    notes = [line for line in out.getvalue().splitlines() if "tokenizer" in line]
    assert notes == [f"note: no tokenizer written: the run's data.tokenizer names no "
                     f"tokenizer.json (external, or a path that is gone); copy the tokenizer its "
                     f"data was made with into {tmp_path} before AutoTokenizer.from_pretrained"]


# --------------------------------------------------------------------------------------------
# MoE: which transformers class, refusals, and megatron's routing against the exported router
# (no processes; the logits through train.py checkpoints: tests/test_moe_checkpoint.py).
# --------------------------------------------------------------------------------------------
MOE = {"name": "moe_tiny", "num_layers": 2, "hidden_size": 72, "num_attention_heads": 4,
       "num_query_groups": 2, "ffn_hidden_size": 200, "seq_length": 64, "swiglu": True,
       "normalization": "RMSNorm", "add_bias_linear": False, "position_embedding_type": "rope",
       "share_embeddings_and_output_weights": False, "num_moe_experts": 4, "moe_router_topk": 2,
       "moe_ffn_hidden_size": 100, "moe_layer_freq": 1, "qk_layernorm": False,
       "moe_shared_expert_intermediate_size": None}


def _moe_tensors(m: dict) -> dict:
    """Zero logical tensors of every key the MoE export reads, in the checkpoint's shapes."""
    h, L, e, f = m["hidden_size"], m["num_layers"], m["num_moe_experts"], m["moe_ffn_hidden_size"]
    d = h // m["num_attention_heads"]
    qkv = (m["num_attention_heads"] + 2 * m["num_query_groups"]) * d
    p = "decoder.layers."
    shapes = {"embedding.word_embeddings.weight": (320, h), "output_layer.weight": (320, h),
              "decoder.final_layernorm.weight": (h,),
              p + "self_attention.linear_qkv.layer_norm_weight": (L, h),
              p + "self_attention.linear_qkv.weight": (L, qkv, h),
              p + "self_attention.linear_proj.weight": (L, h, h),
              p + "self_attention.q_layernorm.weight": (L, d),
              p + "self_attention.k_layernorm.weight": (L, d),
              p + "mlp.linear_fc1.layer_norm_weight": (L, h), p + "mlp.router.weight": (L, e, h),
              p + "mlp.experts.experts.linear_fc1.weight": (L, e, 2 * f, h),
              p + "mlp.experts.experts.linear_fc2.weight": (L, e, h, f)}
    return {k: torch.zeros(s) for k, s in shapes.items()}


@pytest.mark.parametrize("changes,arch", [({}, "mixtral"), ({"qk_layernorm": True}, "qwen3_moe"),
                                          ({"qk_layernorm": True, "moe_router_pre_softmax": True},
                                           "qwen3_moe")])
def test_moe_class_follows_qk_layernorm(changes, arch):
    from ckpt.families import for_export

    assert for_export({**MOE, **changes}).model_type == arch


@pytest.mark.parametrize("changes,named", [
    ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
    ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5"),
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias=True"),
    ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor=1.0"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True with qk_layernorm=False"),
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"add_bias_linear": True}, "add_bias_linear=True"),
])
def test_moe_settings_no_transformers_class_computes_are_refused(changes, named):
    from ckpt.families import for_export
    from ckpt.hf.hf_export import ExportError

    with pytest.raises(ExportError, match=re.escape(named)):
        for_export({**MOE, **changes})


def test_dense_qk_layernorm_is_qwen3_and_with_qkv_bias_refused():
    from ckpt.families import for_export
    from ckpt.hf.hf_export import ExportError

    dense = {k: v for k, v in MODEL.items()}
    assert for_export(dense).model_type == "llama"
    assert for_export({**dense, "qk_layernorm": True}).hf_class == "Qwen3ForCausalLM"
    with pytest.raises(ExportError, match="qk_layernorm=True with add_qkv_bias=True"):
        for_export({**dense, "qk_layernorm": True, "add_qkv_bias": True})
    gpt = {"num_attention_heads": 4, "qk_layernorm": True}  # LayerNorm, bias, learned positions
    with pytest.raises(ExportError, match="qk_layernorm / add_qkv_bias"):
        for_export(gpt)
    # Qwen2's biases on a model Qwen2 does not compute otherwise (learned positions): refused.
    with pytest.raises(ExportError, match="no transformers class computes this model"):
        for_export({**dense, "add_qkv_bias": True, "position_embedding_type": "learned_absolute"})


@pytest.mark.parametrize("changes", [{}, {"qk_layernorm": True},
                                     {"qk_layernorm": True, "moe_router_pre_softmax": True}])
def test_exported_router_weights_equal_megatrons(changes):
    """megatron-core 0.19.2's top-k routing (``moe_utils.topk_routing_with_score_function``, as
    ``TopKRouter.routing`` calls it) and the exported config's transformers router pick the same
    experts with the same weights (each token's weights over its top-k)."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from ckpt.families import for_export

    m = {**MOE, **changes}
    arch = for_export(m)
    config, _ = arch.build(_moe_tensors(m), m, 257, {})
    router = getattr(transformers, arch.hf_class)(config).model.layers[0].mlp.gate
    logits = torch.randn(500, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4, 72))  # router logits = the first 4 hidden values
        _, weights, index = router(torch.nn.functional.pad(logits, (0, 68)))
    hf = torch.zeros_like(logits).scatter(1, index, weights)
    megatron, routed = topk_routing_with_score_function(
        logits, 2, use_pre_softmax=bool(m.get("moe_router_pre_softmax", False)))
    assert torch.equal(routed, hf > 0)
    torch.testing.assert_close(hf, megatron, rtol=0, atol=1e-6)
    renormalised = not m.get("moe_router_pre_softmax", False)
    assert torch.allclose(hf.sum(1), torch.ones(500)) == renormalised


def test_expert_widths_are_not_taken_for_ffn_hidden_size():
    """The checkpoint reader the export goes through infers ffn_hidden_size from a dense fc2
    only, and moe_ffn_hidden_size from a routed expert's: moe_tiny's experts are 100 wide, its
    recorded ffn_hidden_size is 200."""
    from ckpt.stock.specs import infer_dims

    shapes = {k: tuple(v.shape) for k, v in _moe_tensors(MOE).items()}
    assert infer_dims(shapes) == {"hidden_size": 72, "moe_ffn_hidden_size": 100}
    shapes["decoder.layers.mlp.linear_fc2.weight"] = (2, 72, 200)
    assert infer_dims(shapes)["ffn_hidden_size"] == 200
