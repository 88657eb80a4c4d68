"""Model FLOPs per iteration and peak memory, for the progress line (Megatron-LM's figures).

:func:`model_flops_per_iteration` is Megatron-LM's ``num_floating_point_operations``
(``megatron/training/training.py``, the dense-transformer form; Narayanan et al. 2021, appendix
"Floating-point operations"): each GEMM 3 times (forward, weight and data gradient), 2 FLOPs per
multiply-add. Megatron-LM prints ``throughput per GPU (TFLOP/s/GPU)`` = FLOPs per iteration /
(iteration seconds x 10^12 x world size); :func:`tflops_per_gpu` does the same.
"""

from __future__ import annotations

import resource
import sys

import torch


def model_flops_per_iteration(cfg, padded_vocab: int) -> float:
    """FLOPs of one training iteration (``data.global_batch_size`` sequences) of ``cfg.model``:

    ``12 B s L h^2 ((1 + g / a + o / 2 + s / h) + (f / h) m + V / (2 L h))`` with ``B`` = global
    batch, ``s`` = seq_length, ``L`` = num_layers, ``h`` = hidden_size, ``a`` = heads, ``g`` =
    query groups, ``o`` = 1 with ``attention_output_gate`` (gate rows in the QKV projection, as
    many as the query's; else 0), ``f`` = ffn_hidden_size, ``m`` = 3/2 for SwiGLU (else 1), ``V`` =
    padded vocabulary (Megatron-LM's formula, ``gate_projection_size`` included; the query
    projection equals h here: kv_channels = h / a).
    GTP's weight all-gathers and recomputation are not model FLOPs and are not counted.
    """
    m = cfg.model
    b, s = cfg.data.global_batch_size, m.seq_length
    L, h, a, f = m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size
    g = m.get("num_query_groups") or a
    gated = 1.5 if m.swiglu else 1.0
    gate = 0.5 if m.get("attention_output_gate", False) else 0.0
    return 12.0 * b * s * L * h * h * (
        (1 + g / a + gate + s / h) + (f / h) * gated + padded_vocab / (2 * L * h))


def tflops_per_gpu(flops: float, seconds: float, world_size: int) -> float:
    """Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)``."""
    return flops / (seconds * 1e12 * world_size)


def peak_memory_bytes() -> int:
    """This process's peak memory, bytes: ``torch.cuda.max_memory_allocated()`` on CUDA (as
    Megatron-LM's ``max allocated``), else the peak resident set size (``ru_maxrss``)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
