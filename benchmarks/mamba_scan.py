"""The plain-torch Mamba-2 scan (``mcore_compat.mamba_ops.ssd_scan``, chunked) against the
step-by-step recurrence it computes, forward and backward, on CPU.

    python -m benchmarks.mamba_scan            # lengths 256 and 1024, 3 repeats
    python -m benchmarks.mamba_scan --quick    # length 256, 2 repeats

Both run in this process, in turns (chunked, loop, chunked, ...) so that drifting machine load
hits both alike; the table shows the median time of a forward and backward pass over the
repeats and the loop's time as a multiple of the chunked scan's. Sizes: batch 2, 8 heads of
dim 16, 2 groups, state 16, chunk 64, fp32. Output: the table on stdout and
``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import runs
from mcore_compat.mamba_ops import ssd_scan

BATCH, HEADS, HEADDIM, GROUPS, STATE, CHUNK = 2, 8, 16, 2, 16, 64


def loop_scan(x, dt, A, B, C):
    """The recurrence one step at a time (all heads at once): the naive baseline."""
    per_group = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(per_group, 2), C.repeat_interleave(per_group, 2)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return torch.stack(ys, 1)


def _inputs(length: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, length, HEADS, HEADDIM, generator=g)
    dt = torch.rand(BATCH, length, HEADS, generator=g) * 0.1
    A = -torch.rand(HEADS, generator=g) - 0.5
    B = torch.randn(BATCH, length, GROUPS, STATE, generator=g)
    C = torch.randn(BATCH, length, GROUPS, STATE, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


def _time(fn, length: int) -> float:
    args = _inputs(length)
    t0 = time.perf_counter()
    fn(*args).square().sum().backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mamba_scan",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    runs.add_run_args(parser, "length 256 only (2 repeats)", "timed passes per case (default 3)")
    args = parser.parse_args(argv)
    lengths = [256] if args.quick else args.lengths
    repeats = args.repeats or (2 if args.quick else 3)
    out = runs.prepare_out(args.out, "mamba_scan", torch.get_num_threads())
    cases = {"chunked": lambda *a: ssd_scan(*a, CHUNK)[0], "loop": loop_scan}
    return runs.chunked_vs_loop("mamba_scan", cases, _time, lengths, repeats, out)


if __name__ == "__main__":
    import sys

    sys.exit(main())
