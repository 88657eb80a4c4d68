"""``python -m gtp export`` of a Llama-family megatron model (RMSNorm, no linear bias, SwiGLU,
RoPE, grouped-query attention) to ``LlamaForCausalLM``: the logits match megatron's.

The model is built here directly with megatron-core (the recipes' model config does not offer
RMSNorm/no-bias yet) and saved with dist_checkpointing plus the run-config record the export
reads. GPT models and the layouts are covered in tests/test_eval_export_layouts.py.
"""

from __future__ import annotations

import os

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


def test_llama_export_logits_equal_megatron(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from gtp import cli

    root = tmp_path / "ckpt"
    tokens, logits = run_distributed(_build_and_save, 1, str(root), timeout=300)[0]
    assert cli.main(["export", str(root), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_key_value_heads == 2 and model.lm_head.weight.shape == (VOCAB, 64)
    with torch.no_grad():
        hf = model(tokens).logits
    diff = (hf - logits[..., :VOCAB]).abs().max().item()
    assert diff <= 1e-4, diff
