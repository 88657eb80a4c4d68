"""The progress line's model FLOPs (Megatron-LM's formula) against a GEMM-by-GEMM count."""

from __future__ import annotations

import pytest
from compose import make_cfg

from recipes.metrics.logger import format_progress
from recipes.metrics.throughput import model_flops_per_iteration, tflops_per_gpu


def gemm_count(B, s, L, h, a, g, f, V, swiglu, output_gate=False) -> int:
    """2 FLOPs per multiply-add, each GEMM forward + 2 backward, per token of B x s."""
    kv = h // a
    gate = a if output_gate else 0             # a gate head per query head (attention_output_gate)
    per_layer = (2 * h * (a + gate + 2 * g) * kv  # linear_qkv
                 + 2 * s * a * kv * 2          # Q K^T and scores x V, over s keys
                 + 2 * a * kv * h              # linear_proj
                 + 2 * h * f * (2 if swiglu else 1) + 2 * f * h)  # linear_fc1, linear_fc2
    return 3 * B * s * (L * per_layer + 2 * h * V)


@pytest.mark.parametrize("model, groups", [("tiny", 4), ("llama_tiny", 2), ("llama3_8b", 8)])
def test_model_flops_match_a_gemm_count(model, groups):
    cfg = make_cfg(f"model={model}")
    m = cfg.model
    V = 128256 if model == "llama3_8b" else 320
    want = gemm_count(cfg.data.global_batch_size, m.seq_length, m.num_layers, m.hidden_size,
                      m.num_attention_heads, groups, m.ffn_hidden_size, V, m.swiglu)
    assert model_flops_per_iteration(cfg, V) == pytest.approx(want, rel=1e-12)


def test_model_flops_count_the_gate_rows_of_gated_attention():
    cfg = make_cfg("model=llama_tiny", "model.attention_output_gate=true")
    m = cfg.model
    want = gemm_count(cfg.data.global_batch_size, m.seq_length, m.num_layers, m.hidden_size,
                      m.num_attention_heads, 2, m.ffn_hidden_size, 320, m.swiglu, True)
    assert model_flops_per_iteration(cfg, 320) == pytest.approx(want, rel=1e-12)


def test_progress_line_names_throughput_peak_memory_and_global_tokens():
    assert tflops_per_gpu(8e12, 2.0, 4) == 1.0
    line = format_progress(3, 10, {"consumed-samples": 48, "iteration-time": 0.5,
                                   "tokens-per-sec": 2048.0, "learning-rate": 1e-3,
                                   "lm loss": 5.0, "grad-norm": 1.0, "num-zeros": 0,
                                   "throughput": 1.25, "peak-memory-bytes": 3 * 2**30},
                           full=True)  # logger.console_line=full
    assert "throughput per GPU (TFLOP/s/GPU): 1.25 |" in line
    assert "peak memory per rank: 3.00 GiB |" in line and "tokens/s (global):" in line
