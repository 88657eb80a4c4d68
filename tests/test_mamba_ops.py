"""mcore_compat.mamba_ops: the plain-torch Mamba-2 kernels against the recurrence they compute,
step by step, in fp64; their gradients by finite differences (torch.autograd.gradcheck in its
fast mode: a random projection v^T J u of the Jacobian, numerical against analytical, instead of
every column: 1 s instead of 72 s, and a state carried across chunks without its gradient still
fails both checks)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore_compat import mamba_ops

# batch, length (not a multiple of most chunk sizes), heads, head dim, groups, state size
BATCH, LENGTH, HEADS, HEADDIM, GROUPS, STATE = 2, 21, 4, 3, 2, 5


def _inputs(seed: int = 0, length: int = LENGTH, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return dict(x=rand(BATCH, length, HEADS, HEADDIM), dt=rand(BATCH, length, HEADS),
                A=-torch.rand(HEADS, generator=g, dtype=dtype) - 0.5,
                B=rand(BATCH, length, GROUPS, STATE), C=rand(BATCH, length, GROUPS, STATE),
                D=rand(HEADS, HEADDIM), z=rand(BATCH, length, HEADS, HEADDIM),
                dt_bias=rand(HEADS), h0=rand(BATCH, HEADS, HEADDIM, STATE))


def _recurrence(x, dt, A, B, C, h0):
    """One step at a time, per head: h <- exp(dt A) h + dt x B^T, y = h C (head i reads group
    i // (heads / groups))."""
    per_group = HEADS // GROUPS
    h = h0.clone()
    ys = []
    for t in range(x.shape[1]):
        y_t = []
        for i in range(HEADS):
            grp = i // per_group
            decay = torch.exp(dt[:, t, i] * A[i])[:, None, None]
            h[:, i] = decay * h[:, i] + (dt[:, t, i, None, None] * x[:, t, i, :, None]
                                         * B[:, t, grp, None, :])
            y_t.append(torch.einsum("bpn,bn->bp", h[:, i], C[:, t, grp]))
        ys.append(torch.stack(y_t, dim=1))
    return torch.stack(ys, dim=1), h


def test_segsum_is_the_sum_of_the_steps_between():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    want = torch.tensor([[0, -math.inf, -math.inf, -math.inf], [2, 0, -math.inf, -math.inf],
                         [6, 4, 0, -math.inf], [14, 12, 8, 0]], dtype=torch.float64)
    assert torch.equal(mamba_ops.segsum(x), want)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 32])
def test_the_chunked_scan_is_the_recurrence(chunk_size):
    a = _inputs()
    dt = F.softplus(a["dt"])
    want_y, want_h = _recurrence(a["x"], dt, a["A"], a["B"], a["C"], a["h0"])
    y, h = mamba_ops.ssd_scan(a["x"], dt, a["A"], a["B"], a["C"], chunk_size, a["h0"])
    assert y.dtype == torch.float64 and y.shape == want_y.shape
    assert (y - want_y).abs().max() < 1e-12 and (h - want_h).abs().max() < 1e-12


def test_the_combined_scan_adds_bias_softplus_limit_skip_and_gate():
    a = _inputs(1)
    limit = (0.1, 2.0)
    dt = F.softplus(a["dt"] + a["dt_bias"]).clamp(*limit)
    y0, h = _recurrence(a["x"], dt, a["A"], a["B"], a["C"], a["h0"])
    want = (y0 + a["x"] * a["D"]) * F.silu(a["z"])
    y, final = mamba_ops.mamba_chunk_scan_combined(
        a["x"], a["dt"], a["A"], a["B"], a["C"], 8, D=a["D"], z=a["z"], dt_bias=a["dt_bias"],
        initial_states=a["h0"], dt_softplus=True, dt_limit=limit, return_final_states=True)
    assert (y - want).abs().max() < 1e-12 and (final - h).abs().max() < 1e-12
    # D per head: the same skip for every channel of a head.
    y1 = mamba_ops.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8,
                                             D=a["D"][:, 0], dt_softplus=True)
    y2 = mamba_ops.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8,
                                             D=a["D"][:, :1].expand(HEADS, HEADDIM),
                                             dt_softplus=True)
    assert torch.equal(y1, y2)


def test_the_scan_gradients_match_finite_differences():
    a = _inputs(2, length=9)
    args = tuple(a[k].clone().requires_grad_() for k in ("x", "dt", "A", "B", "C", "h0"))

    def scan(x, dt, A, B, C, h0):
        return mamba_ops.ssd_scan(x, F.softplus(dt), A, B, C, 4, h0)

    assert torch.autograd.gradcheck(scan, args, fast_mode=True)


def test_the_split_conv1d_scan_is_the_conv_then_the_scan():
    a = _inputs(3)
    dim, n, width = HEADS * HEADDIM, STATE, 4
    g = torch.Generator().manual_seed(4)
    zxbcdt = torch.randn(BATCH, LENGTH, 2 * dim + 2 * GROUPS * n + HEADS, generator=g,
                         dtype=torch.float64)
    weight = torch.randn(dim + 2 * GROUPS * n, width, generator=g, dtype=torch.float64)
    bias = torch.randn(dim + 2 * GROUPS * n, generator=g, dtype=torch.float64)
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * GROUPS * n, HEADS], dim=-1)
    # The causal depthwise convolution, tap by tap.
    conv = bias.expand_as(xbc).clone()
    for k in range(width):
        shift = width - 1 - k
        conv[:, shift:] += weight[:, k] * xbc[:, :LENGTH - shift]
    conv = F.silu(conv)
    x, B, C = torch.split(conv, [dim, GROUPS * n, GROUPS * n], dim=-1)
    y0, _ = _recurrence(x.reshape(BATCH, LENGTH, HEADS, HEADDIM),
                        F.softplus(dt + a["dt_bias"]), a["A"],
                        B.reshape(BATCH, LENGTH, GROUPS, n), C.reshape(BATCH, LENGTH, GROUPS, n),
                        torch.zeros(BATCH, HEADS, HEADDIM, n, dtype=torch.float64))
    gate = z.reshape(BATCH, LENGTH, HEADS, HEADDIM)
    want = ((y0 + x.reshape(BATCH, LENGTH, HEADS, HEADDIM) * a["D"]) * F.silu(gate))
    y = mamba_ops.mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, a["dt_bias"], a["A"],
                                                   a["D"], 8, ngroups=GROUPS)
    assert (y - want.reshape(BATCH, LENGTH, dim)).abs().max() < 1e-12
    # D per head with headdim (megatron's default, D_has_hdim false): the same skip per head.
    per_head = mamba_ops.mamba_split_conv1d_scan_combined(
        zxbcdt, weight, bias, a["dt_bias"], a["A"], a["D"][:, 0], 8, ngroups=GROUPS,
        headdim=HEADDIM)
    want_head = (y0 + x.reshape(BATCH, LENGTH, HEADS, HEADDIM) * a["D"][:, :1]) * F.silu(gate)
    assert (per_head - want_head.reshape(BATCH, LENGTH, dim)).abs().max() < 1e-12
    # With the norm: RMSNorm(y * silu(z)) in each group's channels (norm_before_gate false,
    # megatron's Mamba-2 setting), as mamba_ssm's kernel normalises.
    w = torch.randn(dim, generator=g, dtype=torch.float64)
    y_norm = mamba_ops.mamba_split_conv1d_scan_combined(
        zxbcdt, weight, bias, a["dt_bias"], a["A"], a["D"], 8, ngroups=GROUPS,
        rmsnorm_weight=w, norm_before_gate=False)
    gated = (y0 + x.reshape(BATCH, LENGTH, HEADS, HEADDIM) * a["D"]).reshape(
        BATCH, LENGTH, dim) * F.silu(z)
    parts = gated.split(dim // GROUPS, dim=-1)
    want = torch.cat([q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) for q in parts],
                     -1) * w
    assert (y_norm - want).abs().max() < 1e-12


def test_the_split_scan_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(6)
    dim, n = HEADS * HEADDIM, STATE
    zxbcdt = torch.randn(1, 7, 2 * dim + 2 * GROUPS * n + HEADS, generator=g,
                         dtype=torch.float64, requires_grad=True)
    weight = torch.randn(dim + 2 * GROUPS * n, 3, generator=g, dtype=torch.float64,
                         requires_grad=True)
    A = (-torch.rand(HEADS, generator=g, dtype=torch.float64) - 0.5).requires_grad_()
    dt_bias, D = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                  for shape in ((HEADS,), (HEADS, HEADDIM)))

    def split_scan(zxbcdt, weight, A, dt_bias, D):
        return mamba_ops.mamba_split_conv1d_scan_combined(zxbcdt, weight, None, dt_bias, A, D, 4,
                                                          ngroups=GROUPS)

    assert torch.autograd.gradcheck(split_scan, (zxbcdt, weight, A, dt_bias, D), fast_mode=True)


def test_a_negative_dt_is_clamped_to_zero_by_default():
    """mamba_ssm's kernel always applies dt_limit: by default a negative dt becomes 0 (no decay,
    no input at that step)."""
    a = _inputs(7)
    y = mamba_ops.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8)
    want, _ = _recurrence(a["x"], a["dt"].clamp(min=0), a["A"], a["B"], a["C"],
                          torch.zeros_like(a["h0"]))
    assert (a["dt"] < 0).any() and (y - want).abs().max() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_inputs_come_back_in_their_dtype_close_to_fp64(dtype):
    a = _inputs(8)
    want = mamba_ops.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8,
                                               D=a["D"], dt_softplus=True)
    low = {k: a[k].to(dtype) for k in ("x", "dt", "B", "C", "D")}
    got = mamba_ops.mamba_chunk_scan_combined(low["x"], low["dt"], a["A"].float(), low["B"],
                                              low["C"], 8, D=low["D"], dt_softplus=True)
    # Inputs rounded to the dtype (fp32: 24 bits, bf16: 8), the scan itself in fp32: errors of a
    # few roundings of the largest output, far below what a wrong scan moves it by.
    assert got.dtype == dtype
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    assert (got.double() - want).abs().max() < 64 * ulp * want.abs().max()


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_rmsnorm_fn_normalises_each_group(norm_before_gate):
    g = torch.Generator().manual_seed(5)
    x, z = (torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(8, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64)
    got = mamba_ops.rmsnorm_fn(x, w, bias, z=z, eps=1e-5, group_size=4,
                               norm_before_gate=norm_before_gate)
    inner = x if norm_before_gate else x * F.silu(z)
    halves = [h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) for h in inner.split(4, -1)]
    want = torch.cat(halves, -1) * w + bias
    if norm_before_gate:
        want = want * F.silu(z)
    assert (got - want).abs().max() < 1e-13


def test_what_the_kernels_do_not_do_is_refused_by_name():
    a = _inputs()
    with pytest.raises(NotImplementedError, match=r"\['seq_idx'\]"):
        mamba_ops.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 4,
                                            seq_idx=torch.zeros(BATCH, LENGTH, dtype=torch.int32))
    with pytest.raises(ValueError, match="groups=2 must divide heads=3"):
        mamba_ops.ssd_scan(a["x"][:, :, :3], a["dt"][:, :, :3], a["A"][:3], a["B"], a["C"], 4)


# --------------------------------------------------------------------------------------------
# mcore_compat.mamba_cpu: the kernels installed into megatron's MambaMixer
# --------------------------------------------------------------------------------------------
def test_install_puts_the_kernels_where_the_mixer_looks_for_mamba_ssm():
    import megatron.core.ssm.mamba_mixer as mixer

    from mcore_compat import mamba_cpu

    assert mamba_cpu.install() is True
    assert mamba_cpu.install() is True  # idempotent
    assert mixer.HAVE_MAMBA_SSM is True
    assert mixer.mamba_split_conv1d_scan_combined is mamba_ops.mamba_split_conv1d_scan_combined
    assert mixer.mamba_chunk_scan_combined is mamba_ops.mamba_chunk_scan_combined
    assert mixer.ExtendedRMSNorm is mamba_cpu.ExtendedRMSNorm
    norm = mixer.ExtendedRMSNorm(8, eps=1e-5, group_size=4, norm_before_gate=False)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    x, z = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    norm.double()
    want = mamba_ops.rmsnorm_fn(x, norm.weight, None, z, 1e-5, 4, False)
    assert torch.equal(norm(x, z), want)


def test_install_leaves_megatron_alone_where_mamba_ssm_runs(monkeypatch):
    import megatron.core.ssm.mamba_mixer as mixer

    from mcore_compat import mamba_cpu

    own = object()
    monkeypatch.delattr(mixer, "_mcore_compat_kernels", raising=False)
    monkeypatch.setattr(mixer, "HAVE_MAMBA_SSM", True)  # as when mamba_ssm imported
    monkeypatch.setattr(mixer, "mamba_chunk_scan_combined", own)
    assert mamba_cpu.install() is False
    assert mixer.mamba_chunk_scan_combined is own
