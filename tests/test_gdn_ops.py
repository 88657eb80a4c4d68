"""mcore_compat.gdn_cpu: GatedDeltaNet's kernels without flash-linear-attention, against what
they compute written out step by step in fp64.

The causal convolution and the L2 norm keep fp64 inputs in fp64, so they are compared within
1e-12. The gated delta rule is megatron-core's ``torch_chunk_gated_delta_rule``, which computes
in fp32 whatever its inputs; it is compared with the fp64 recurrence run on the same
(fp32-representable) inputs within :func:`_fp32_bound`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore_compat import gdn_cpu

BATCH, HEADS, KDIM, VDIM = 2, 3, 8, 6
U_FP32 = 2.0 ** -24


def _rule_inputs(length: int, seed: int = 0):
    """fp32-representable q, k (L2-normalized, as GatedDeltaNet passes them), v, g < 0 and
    beta in (0, 1), in fp64."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float().double()

    q = F.normalize(rand(BATCH, length, HEADS, KDIM), dim=-1).float().double()
    k = F.normalize(rand(BATCH, length, HEADS, KDIM), dim=-1).float().double()
    v = rand(BATCH, length, HEADS, VDIM)
    g = (-F.softplus(rand(BATCH, length, HEADS)) * 0.5).float().double()
    beta = torch.sigmoid(rand(BATCH, length, HEADS)).float().double()
    return q, k, v, g, beta


def _recurrence(q, k, v, g, beta):
    """The gated delta rule one step at a time, head by head: with ``q`` scaled by
    ``1/sqrt(K)``, ``S <- exp(g_t) S``, then ``S <- S + beta_t k_t (v_t - S^T k_t)^T``,
    ``o_t = S^T q_t`` (``S``: ``K x V``)."""
    b, length, h, kd = q.shape
    out = torch.zeros(b, length, h, v.shape[-1], dtype=q.dtype)
    for n in range(b):
        for i in range(h):
            state = torch.zeros(kd, v.shape[-1], dtype=q.dtype)
            for t in range(length):
                state = torch.exp(g[n, t, i]) * state
                kt, vt = k[n, t, i], v[n, t, i]
                state = state + beta[n, t, i] * torch.outer(kt, vt - state.T @ kt)
                out[n, t, i] = state.T @ (q[n, t, i] / math.sqrt(kd))
    return out


def _fp32_bound(length: int, chunk: int, scale: float) -> float:
    """fp32 against fp64 (unit roundoff ``u``): within a chunk an output sums terms of
    reductions over ``K`` and over the chunk's ``min(chunk, length)`` steps (the triangular
    solve, the masked products), ``u * sqrt(terms)`` each under the random-rounding model; each
    of the ``ceil(length / chunk)`` chunks adds its own through the carried state; a factor 4
    for the few chained reductions; times the output's scale. (Measured: 3e-7 at length 70,
    chunk 64, a twentieth of the bound; a wrong decay or a dropped term moves outputs by 1e-2.)"""
    steps = min(chunk, length)
    chunks = math.ceil(length / chunk)
    return 4 * chunks * math.sqrt(KDIM * steps) * U_FP32 * scale


@pytest.mark.parametrize("length,chunk", [(21, 4), (21, 64), (70, 16), (70, 64)])
def test_the_chunked_rule_is_the_recurrence(length, chunk):
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _rule_inputs(length)
    want = _recurrence(q, k, v, g, beta)
    got, state = torch_chunk_gated_delta_rule(q.float(), k.float(), v.float(), g.float(),
                                              beta.float(), chunk_size=chunk)
    assert got.dtype == torch.float32 and got.shape == want.shape and state is None
    err = (got.double() - want).abs().max().item()
    assert err <= _fp32_bound(length, chunk, want.abs().max().item()), err


def test_the_installed_rule_takes_fla_arguments_and_its_gradients_are_the_recurrences():
    length = 21
    inputs = _rule_inputs(length, seed=1)
    ref = [t.clone().requires_grad_() for t in inputs]
    _recurrence(*ref).square().sum().backward()
    got = [t.float().requires_grad_() for t in inputs]
    q, k, v, g, beta = got
    out, state = gdn_cpu.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                                output_final_state=False,
                                                use_qk_l2norm_in_kernel=False, cu_seqlens=None)
    assert state is None
    out.square().sum().backward()
    for name, a, b in zip("q k v g beta".split(), got, ref):
        scale = b.grad.abs().max().item()
        err = (a.grad.double() - b.grad).abs().max().item()
        # The backward pass chains the forward's reductions once more: twice the bound.
        assert err <= 2 * _fp32_bound(length, 64, scale), (name, err, scale)


def test_install_puts_the_torch_functions_where_megatron_calls_them():
    from megatron.core.ssm.gated_delta_net import common, gdn

    assert gdn_cpu.install()  # no fla here
    assert common.HAVE_FLA and gdn.chunk_gated_delta_rule is gdn_cpu.chunk_gated_delta_rule
    assert (common.causal_conv1d, common.l2norm) == (gdn_cpu.causal_conv1d, gdn_cpu.l2norm)
    assert gdn.causal_conv1d is gdn_cpu.causal_conv1d


def test_the_rule_normalizes_q_and_k_in_the_kernel_when_asked():
    gdn_cpu.install()  # megatron's kernel calls common.l2norm
    q, k, v, g, beta = (t.float() for t in _rule_inputs(9, seed=2))
    out, _ = gdn_cpu.chunk_gated_delta_rule(3 * q, 0.5 * k, v, g, beta,
                                            use_qk_l2norm_in_kernel=True)
    want, _ = gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta)
    assert (out - want).abs().max() < 1e-5


@pytest.mark.parametrize("what,kwargs", [
    ("cu_seqlens", {"cu_seqlens": torch.tensor([0, 4])}),
    ("initial_state", {"initial_state": torch.zeros(1)}),
    ("output_final_state", {"output_final_state": True}),
    ("scale", {"scale": 0.5}),
])
def test_what_is_not_ported_is_refused_by_name(what, kwargs):
    q, k, v, g, beta = (t.float() for t in _rule_inputs(4))
    with pytest.raises(NotImplementedError, match=what):
        gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)


def test_the_causal_conv1d_is_the_tap_by_tap_sum_then_silu():
    gen = torch.Generator().manual_seed(3)
    length, dim, width = 11, 5, 4
    x = torch.randn(BATCH, length, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(dim, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(dim, generator=gen, dtype=torch.float64)
    want = bias.expand_as(x).clone()
    for tap in range(width):  # tap w-1 reads step t, tap 0 step t - (w - 1)
        shift = width - 1 - tap
        want[:, shift:] += weight[:, tap] * x[:, :length - shift]
    y, state = gdn_cpu.causal_conv1d(x=x, weight=weight, bias=bias, activation="silu")
    assert state is None and y.dtype == torch.float64
    assert (y - F.silu(want)).abs().max() < 1e-12
    plain, _ = gdn_cpu.causal_conv1d(x, weight, None, activation=None)
    assert (plain - (want - bias)).abs().max() < 1e-12
    with pytest.raises(ValueError, match="activation='gelu'"):
        gdn_cpu.causal_conv1d(x, weight, bias, activation="gelu")


def test_l2norm_divides_by_the_root_of_the_sum_of_squares_plus_eps():
    x = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert (gdn_cpu.l2norm(x) - want).abs().max() < 1e-12
    half = gdn_cpu.l2norm(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dim=0"):
        gdn_cpu.l2norm(x, dim=0)
