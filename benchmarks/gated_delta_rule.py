"""The gated delta rule of GatedDeltaNet (``G`` layers) on CPU: megatron-core's chunked torch
kernel (``torch_chunk_gated_delta_rule``, chunks of 64, as ``mcore_compat.gdn_cpu`` installs it)
against the step-by-step recurrence it computes, forward and backward.

    python -m benchmarks.gated_delta_rule            # lengths 256 and 1024, 3 repeats
    python -m benchmarks.gated_delta_rule --quick    # length 256, 2 repeats

Both run in this process, in turns (chunked, loop, chunked, ...) so that drifting machine load
hits both alike; the table shows the median time of a forward and backward pass over the
repeats and the loop's time as a multiple of the chunked kernel's. Sizes: batch 2, 4 heads,
key and value head dim 32, fp32. Output: the table on stdout and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks import runs

BATCH, HEADS, KDIM, VDIM = 2, 4, 32, 32


def loop_rule(q, k, v, g, beta):
    """The recurrence one step at a time (all heads at once): ``S <- exp(g_t) S``,
    ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T q_t / sqrt(K)``: the naive baseline."""
    q = q / q.shape[-1] ** 0.5
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1)


def _inputs(length: int):
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(BATCH, length, HEADS, KDIM, generator=gen), dim=-1)
    k = F.normalize(torch.randn(BATCH, length, HEADS, KDIM, generator=gen), dim=-1)
    v = torch.randn(BATCH, length, HEADS, VDIM, generator=gen)
    g = -F.softplus(torch.randn(BATCH, length, HEADS, generator=gen))
    beta = torch.sigmoid(torch.randn(BATCH, length, HEADS, generator=gen))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _time(fn, length: int) -> float:
    args = _inputs(length)
    t0 = time.perf_counter()
    fn(*args).square().sum().backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    from mcore_compat import gdn_cpu

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gated_delta_rule",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    runs.add_run_args(parser, "length 256 only (2 repeats)", "timed passes per case (default 3)")
    args = parser.parse_args(argv)
    lengths = [256] if args.quick else args.lengths
    repeats = args.repeats or (2 if args.quick else 3)
    out = runs.prepare_out(args.out, "gated_delta_rule", torch.get_num_threads())
    gdn_cpu.install()
    cases = {"chunked": lambda *a: gdn_cpu.chunk_gated_delta_rule(*a)[0], "loop": loop_rule}
    return runs.chunked_vs_loop("gated_delta_rule", cases, _time, lengths, repeats, out)


if __name__ == "__main__":
    import sys

    sys.exit(main())
