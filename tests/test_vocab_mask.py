"""Padded vocabulary rows never reach the loss (recipes.model.build.mask_padded_vocab).

Two gloo ranks as one TP group run megatron's ``vocab_parallel_cross_entropy`` on logits whose
padded columns hold large values, masked by the hook, at padded widths 258 (tp1 view), 264 and
384 (each rank holds its half), in fp32 and bf16. The golden is computed independently in fp64
with plain torch over the 257 real columns only.
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

REAL = 257


class _OutputLayer(torch.nn.Module):
    """Stands in for GPTModel.output_layer: returns ``(logits, None)`` of this rank."""

    def forward(self, logits):
        return logits, None


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.output_layer = _OutputLayer()


def _full_logits(padded: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(padded)
    logits = torch.randn(5, 3, padded, generator=gen) * 3
    logits[..., REAL:] = 40.0  # padded columns that would dominate an unmasked softmax
    labels = torch.randint(0, REAL, (5, 3), generator=gen)
    return logits.to(dtype), labels


def _worker() -> dict:
    from megatron.core import parallel_state, tensor_parallel

    from mcore_compat import cpu as cpu_compat
    from recipes.model.build import mask_padded_vocab

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for padded in (264, 384):
            full, labels = _full_logits(padded, dtype)
            local = full.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
            model = _Model()
            mask_padded_vocab(model, REAL, padded)
            masked, _ = model.output_layer(local)
            loss = tensor_parallel.vocab_parallel_cross_entropy(masked.float(), labels)
            loss.sum().backward()
            width = padded // 2
            pad_cols = [c for c in range(width) if rank * width + c >= REAL]
            out[(str(dtype), padded)] = (loss.detach().double(), local.grad[..., pad_cols])
    parallel_state.destroy_model_parallel()
    return out


def _golden(padded: int, dtype) -> torch.Tensor:
    full, labels = _full_logits(padded, dtype)
    real = full[..., :REAL].double()
    return -torch.log_softmax(real, dim=-1).gather(-1, labels[..., None])[..., 0]


def test_padded_rows_are_out_of_the_softmax_at_tp2_in_fp32_and_bf16():
    results = run_distributed(_worker, 2, timeout=300)
    for rank, res in enumerate(results):
        for (dtype, padded), (loss, pad_grad) in res.items():
            want = _golden(padded, getattr(torch, dtype.split(".")[-1]))
            assert torch.allclose(loss, want, rtol=1e-6, atol=0), (rank, dtype, padded)
            assert pad_grad.numel() > 0 or rank == 0, (rank, padded)
            assert not pad_grad.any(), (rank, dtype, padded)


def test_tp1_hook_masks_the_tail_columns():
    from recipes.model.build import mask_padded_vocab

    model = _Model()
    mask_padded_vocab(model, REAL, 258)
    logits, _ = model.output_layer(torch.zeros(2, 1, 258, dtype=torch.bfloat16))
    assert torch.isneginf(logits[..., REAL:]).all() and not logits[..., :REAL].any()
    untouched = _Model()
    mask_padded_vocab(untouched, 258, 258)  # nothing padded: no hook
    assert not untouched.output_layer._forward_hooks
