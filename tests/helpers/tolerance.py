"""The one tolerance for two computations of a figure that agree only up to fp32 rounding: a
stored golden against this machine's run, another layout, another optimizer implementation,
megatron against transformers (docs/testing.md, "Exact and tolerant comparisons").

Derivation. fp32's unit roundoff is ``u = 2**-24``. A sum of ``n`` positive fp32 terms (the
grad-norm's sum of squares; the loss's mean) carries, under the random-rounding model, a
relative error of standard deviation at most ``u * sqrt(n) / 3`` (recursive summation; the
blocked sums of vectorised kernels do better), so ``u * sqrt(n)`` is 3 sigma for one side. Two
sides that round independently differ by sqrt(2) of that, and a step has a few such reductions
besides the longest: a factor ``SAFETY = 2``. Each training step's rounding moves the weights
by a little more, and over a handful of steps at these learning rates nothing shrinks it, so the
bound grows linearly with the steps since both sides last held the same bits::

    rtol = SAFETY * steps * sqrt(n) * u       (n: the parameter count for a training step)

For the tiny GPT (n = 151,600): 4.6e-5 at one step. bf16 weights amplify a main param's fp32
difference (it can flip a bf16 rounding); measured on Muon + bf16, 2.8e-5 three steps after a
resume (ATEN_CPU_CAPABILITY=avx2), under the bound's 1.4e-4. A real math change is far
outside: docs/testing.md lists what breaking the math gives.
"""

from __future__ import annotations

import math

U_FP32 = 2.0 ** -24
SAFETY = 2
# Parameter counts (``train.py model=... train.dry_run=true``, its "> model:" line): the
# grad-norm's sum of squares, the longest reduction of a step, runs over them.
TINY = 151_600
TINY_SWIGLU = 180_800
TINY_TIED_4_LAYERS = 229_328  # model.num_layers=4, shared embedding and output weights
LLAMA_TINY = 160_488
MOE_TINY = 250_920
HYBRID_MOE_TINY = 112_258
HYBRID_GDN_TINY = 105_620
QWEN3_NEXT_TINY = 142_304


def fp32_rtol(steps: int, terms: int = TINY) -> float:
    """Relative tolerance between two fp32 computations of one figure, ``steps`` training steps
    (or chained reductions) after both sides last held the same bits, whose longest reduction
    has ``terms`` terms (the parameter count for a training step)."""
    if steps < 1 or terms < 1:
        raise ValueError(f"steps and terms must be >= 1, got {steps}, {terms}")
    return SAFETY * steps * math.sqrt(terms) * U_FP32


def assert_fp32_close(got: float, want: float, steps: int, terms: int = TINY, what=()) -> None:
    """``got`` within :func:`fp32_rtol` of ``want`` (relative, no absolute slack); the message
    says the figures, their relative difference and the bound."""
    rtol = fp32_rtol(steps, terms)
    assert math.isclose(got, want, rel_tol=rtol, abs_tol=0), (
        *what, got, want, f"rel {abs(got - want) / abs(want):.3g} > {rtol:.3g}")


# num-zeros counts gradient elements that are exactly 0.0: nearly all are structural (padded
# vocab rows, embedding rows of bytes absent from the batch) and equal under any rounding, but a
# gradient that cancels to exactly 0.0 under one rounding and not another moves the count by one
# now and then (seen: 19656 vs 19657 across GTP layouts). 0.1% of ~2e4 is 20, far below what a
# wrong count moves it by (GTP padding rows: 17664).
ZEROS_RTOL = 1e-3


def assert_zeros_close(got: float, want: float, what=()) -> None:
    """Two ``num-zeros`` counts of differently rounded computations within :data:`ZEROS_RTOL`."""
    assert abs(got - want) <= ZEROS_RTOL * want, (*what, "num-zeros", got, want)
