"""Mamba-2 kernels in plain torch, for machines where ``mamba_ssm``'s Triton kernels cannot run
(no CUDA: ``mamba_ssm`` does not import, and its Triton kernels reject CPU tensors).

The functions take the arguments of the ``mamba_ssm`` functions megatron-core 0.19.2's
``MambaMixer`` calls (``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` and
``mamba_split_conv1d_scan_combined``, ``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn``) and
compute the same math with autograd:

* the SSD scan of Dao and Gu, "Transformers are SSMs" (2024), section 6: per head the recurrence
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``, computed in chunks of
  ``chunk_size`` steps: inside a chunk as a masked quadratic form, across chunks through the
  chunk-final states (:func:`ssd_scan`);
* the causal depthwise convolution of the ``x | B | C`` channels (:func:`causal_conv1d`);
* the gated RMSNorm over groups of channels (:func:`rmsnorm_fn`).

Shapes follow ``mamba_ssm``: ``b`` batch, ``l`` sequence, ``h`` heads, ``p`` head dim,
``g`` groups of heads sharing ``B`` and ``C``, ``n`` state size. The scan runs in fp32 (fp64
inputs stay fp64) and returns the input's dtype. Nothing here is patched into megatron; the
hybrid model family installs these where ``mamba_ssm`` is missing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 tensors, else fp32: what these kernels compute in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def segsum(x: torch.Tensor) -> torch.Tensor:
    """Segment sums ``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``i >= j`` (0 on
    the diagonal) and ``-inf`` above it, so ``exp(segsum(a))`` is the decay from step ``j`` to
    step ``i`` of a causal recurrence. Summed directly (not as a difference of cumulative
    sums), which keeps long products of small decays exact.

    Args:
        x: float ``[..., T]``.

    Returns:
        float ``[..., T, T]``.
    """
    t = x.shape[-1]
    strictly_lower = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)
    terms = x[..., :, None].expand(*x.shape, t).masked_fill(~strictly_lower, 0)
    out = terms.cumsum(dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~lower, -math.inf)


def ssd_scan(x, dt, A, B, C, chunk_size: int, initial_states=None):
    """The SSD scan (``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t`` per head)
    in chunks of ``chunk_size`` steps; any sequence length (the last chunk is zero-padded: a
    padded step has ``dt = 0``, so it neither decays nor adds to the state).

    Args:
        x: ``[b, l, h, p]``; dt: ``[b, l, h]`` (after bias, softplus and limits); A: ``[h]``;
        B, C: ``[b, l, g, n]`` with ``g`` dividing ``h`` (head ``i`` uses group
        ``i // (h / g)``); chunk_size: steps per chunk (> 0); initial_states: ``[b, h, p, n]``
        or None (zeros).

    Returns:
        ``(y [b, l, h, p], final_states [b, h, p, n])`` in fp32 (fp64 for fp64 ``x``).

    Raises:
        ValueError: ``chunk_size`` < 1 or ``g`` not dividing ``h``.
    """
    b, l, h, p = x.shape
    g = B.shape[2]
    if chunk_size < 1 or h % g:
        raise ValueError(f"ssd_scan: chunk_size={chunk_size} must be >= 1 and groups={g} must "
                         f"divide heads={h}")
    dtype = _compute_dtype(x)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    B = B.repeat_interleave(h // g, dim=2)
    C = C.repeat_interleave(h // g, dim=2)
    pad = -l % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    c = (l + pad) // chunk_size
    x, B, C = (t.reshape(b, c, chunk_size, h, -1) for t in (x, B, C))
    dt = dt.reshape(b, c, chunk_size, h)
    xdt = x * dt[..., None]
    dA = (dt * A).permute(0, 3, 1, 2)  # [b, h, c, L]
    dA_cumsum = dA.cumsum(dim=-1)
    # Inside each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(dA_{j+1} + .. + dA_i) dt_j x_j.
    decay = torch.exp(segsum(dA))  # [b, h, c, L, L]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, decay, xdt)
    # Each chunk's own final state, from its inputs alone.
    to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # [b, h, c, L]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, xdt)
    # Across chunks: the state entering chunk k sums every earlier chunk's state, decayed.
    if initial_states is None:
        initial_states = torch.zeros(b, h, p, B.shape[-1], dtype=dtype, device=x.device)
    states = torch.cat([initial_states.to(dtype)[:, None], states], dim=1)  # [b, c+1, h, p, n]
    chunk_decay = torch.exp(segsum(F.pad(dA_cumsum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]
    # The entering state's contribution to each step of its chunk.
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(dA_cumsum))
    return y.reshape(b, c * chunk_size, h, p)[:, :l], final


def _dt(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    dt = dt.to(_compute_dtype(dt))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    # Always, as mamba_ssm's kernel: the default (0, inf) turns a negative dt into 0.
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size: int, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus: bool = False, dt_limit=(0.0, math.inf),
                              return_final_states: bool = False, **unsupported):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` in plain torch: ``dt``
    plus ``dt_bias``, softplus (``dt_softplus``) and clamped to ``dt_limit``, then
    :func:`ssd_scan`, the skip ``+ D x`` and the gate ``* silu(z)``.

    Args:
        x: ``[b, l, h, p]``; dt: ``[b, l, h]``; A: ``[h]``; B, C: ``[b, l, g, n]``;
        D: ``[h, p]`` or ``[h]``; z: ``[b, l, h, p]``; dt_bias: ``[h]``;
        initial_states: ``[b, h, p, n]``.

    Returns:
        ``y [b, l, h, p]`` in ``x``'s dtype, and the final states ``[b, h, p, n]`` (fp32) when
        ``return_final_states``.

    Raises:
        NotImplementedError: packed sequences (``seq_idx``, ``cu_seqlens``) or another
            ``mamba_ssm`` option (named).
    """
    _refuse(seq_idx=seq_idx, cu_seqlens=cu_seqlens, **unsupported)
    y, final = ssd_scan(x, _dt(dt, dt_bias, dt_softplus, dt_limit), A, B, C, chunk_size,
                        initial_states)
    if D is not None:
        y = y + x.to(y.dtype) * (D if D.dim() == 2 else D[:, None]).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def causal_conv1d(x, weight, bias=None, activation=None) -> torch.Tensor:
    """Depthwise causal convolution (``causal_conv1d.causal_conv1d_fn``): channel ``d`` at step
    ``t`` sums ``weight[d, k] * x[d, t - w + 1 + k]`` over the ``w`` taps (zeros before the
    start), plus ``bias``; then SiLU when ``activation`` is ``"silu"`` or ``"swish"``. Computed
    in fp32 (fp64 stays fp64), as the CUDA kernel accumulates.

    Args:
        x: ``[b, d, l]``; weight: ``[d, w]``; bias: ``[d]`` or None.

    Returns:
        ``[b, d, l]`` in ``x``'s dtype.

    Raises:
        ValueError: another ``activation``.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation={activation!r}: valid are None, 'silu', "
                         f"'swish'")
    dtype = _compute_dtype(x)
    width = weight.shape[-1]
    out = F.conv1d(x.to(dtype), weight.to(dtype)[:, None, :],
                   None if bias is None else bias.to(dtype), padding=width - 1,
                   groups=x.shape[1])[..., :x.shape[-1]]
    return (F.silu(out) if activation else out).to(x.dtype)


def rmsnorm_fn(x, weight, bias=None, z=None, eps: float = 1e-6, group_size=None,
               norm_before_gate: bool = True) -> torch.Tensor:
    """``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn``: RMSNorm over groups of
    ``group_size`` channels (None: all of them), times ``weight``, plus ``bias``; with ``z``,
    gated by ``silu(z)`` after the norm (``norm_before_gate``) or before it.

    Args:
        x, z: ``[..., d]``; weight, bias: ``[d]``.

    Returns:
        ``[..., d]`` in ``x``'s dtype (computed in fp32, or fp64).
    """
    dtype = _compute_dtype(x)
    y = x.to(dtype)
    if z is not None and not norm_before_gate:
        y = y * F.silu(z.to(dtype))
    d = y.shape[-1]
    group = group_size or d
    grouped = y.reshape(*y.shape[:-1], d // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = grouped.reshape(y.shape) * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.to(dtype))
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size: int, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, math.inf), return_final_states: bool = False,
                                     activation: str = "silu", rmsnorm_weight=None,
                                     rmsnorm_eps: float = 1e-6, outproj_weight=None,
                                     outproj_bias=None, headdim=None, ngroups: int = 1,
                                     norm_before_gate: bool = True, **unsupported):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined`` in plain torch,
    the training path of megatron's ``MambaMixer``: split the fused input projection into
    ``z | xBC | dt``, convolve ``xBC`` (:func:`causal_conv1d`), split it into ``x | B | C``,
    scan with ``dt`` softplus'ed (:func:`mamba_chunk_scan_combined`), gate by ``silu(z)`` (or,
    with ``rmsnorm_weight``, :func:`rmsnorm_fn` in ``ngroups`` groups, as mamba_ssm's kernel
    normalises), then the optional output projection.

    Args:
        zxbcdt: ``[b, l, 2 d + 2 g n + h]`` with ``d = h p``; conv1d_weight: ``[d + 2 g n, w]``;
        conv1d_bias: ``[d + 2 g n]``; dt_bias, A: ``[h]``; D: ``[h, p]``, or ``[h]`` with
        ``headdim``; initial_states: ``[b, h, p, n]``; ngroups: ``g``.

    Returns:
        ``[b, l, d]`` (``[b, l, out]`` with ``outproj_weight``), and the final states when
        ``return_final_states``.

    Raises:
        ValueError: a 1-D ``D`` without ``headdim``; ``zxbcdt``'s or ``conv1d_weight``'s width
            not as above.
        NotImplementedError: packed sequences (``seq_idx``), channels outside the SSM
            (``zxbcdt`` wider than above) or another option (named).
    """
    _refuse(seq_idx=seq_idx, **unsupported)
    heads = D.shape[0]
    if D.dim() == 1 and headdim is None:
        raise ValueError("mamba_split_conv1d_scan_combined: D of shape [heads] needs headdim")
    headdim = D.shape[1] if D.dim() == 2 else headdim
    dim = heads * headdim
    n, odd = divmod(conv1d_weight.shape[0] - dim, 2 * ngroups)
    if n <= 0 or odd:
        raise ValueError(f"mamba_split_conv1d_scan_combined: conv1d_weight has "
                         f"{conv1d_weight.shape[0]} channels, not {dim} + 2 * {ngroups} * d_state")
    extra = zxbcdt.shape[-1] - (2 * dim + 2 * ngroups * n + heads)
    if extra:
        raise NotImplementedError(f"mcore_compat.mamba_ops does not implement the {extra} "
                                  f"channels of zxbcdt outside the SSM (mamba_ssm's d_nonssm)")
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * n, heads], dim=-1)
    xbc = causal_conv1d(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation)
    x, B, C = torch.split(xbc.transpose(1, 2), [dim, ngroups * n, ngroups * n], dim=-1)
    b, l = zxbcdt.shape[:2]
    gate = z.reshape(b, l, heads, headdim)
    y, final = mamba_chunk_scan_combined(
        x.reshape(b, l, heads, headdim), dt, A, B.reshape(b, l, ngroups, n),
        C.reshape(b, l, ngroups, n), chunk_size,
        D=D.to(_compute_dtype(D)),
        z=gate if rmsnorm_weight is None else None, dt_bias=dt_bias,
        initial_states=initial_states, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=True)
    y = y.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_fn(y, rmsnorm_weight, None, z, rmsnorm_eps, group_size=dim // ngroups,
                       norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


def _refuse(**options) -> None:
    given = [k for k, v in options.items() if v is not None and v is not False]
    if given:
        raise NotImplementedError(f"mcore_compat.mamba_ops does not implement "
                                  f"{sorted(given)} (mamba_ssm's Triton kernels do)")
