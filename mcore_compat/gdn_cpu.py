"""megatron-core 0.19.2's ``GatedDeltaNet`` (``G`` layers) without flash-linear-attention.

``megatron.core.ssm.gated_delta_net.common`` imports fla's ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule``; where fla does not import (no CUDA, or not installed) they are None,
``HAVE_FLA`` is False and ``GatedDeltaNet(...)`` raises ``ImportError: FLA is not installed``.
:func:`install` (only where fla is missing; with it, megatron's path is left alone) puts, in
``common`` and in ``gated_delta_net.gdn`` (which imported the names):

* :func:`causal_conv1d` and :func:`l2norm`: fla's functions in plain torch, the same math;
* :func:`chunk_gated_delta_rule`: megatron's own ``torch_chunk_gated_delta_rule`` (the
  deterministic-mode kernel of ``common.py``, after transformers' Qwen3-Next) behind fla's
  signature;
* ``common.HAVE_FLA`` = True;
* ``_GDNBase``'s ``jit_fuser`` methods (``_apply_gated_norm``,
  ``_prepare_input_for_gated_delta_rule``, ``_compute_g_and_beta``) uncompiled: megatron
  decorates them with ``torch.compile``, which on CPU would build C++ kernels with Inductor at
  the first call of every process (the same math, eagerly);
* on a machine without CUDA, ``common``'s module-global ``torch`` with the CPU proxy of
  :mod:`mcore_compat.cpu` (``_GDNBase.__init__`` allocates ``conv1d``, ``dt_bias`` and ``A_log``
  on ``torch.cuda.current_device()``).

What is not ported: packed sequences (``cu_seqlens``), a carried state (``initial_state``,
``output_final_state``) and a ``scale`` other than ``1/sqrt(key head dim)``: a call with them
raises ``NotImplementedError`` naming the argument (training with ``GatedDeltaNet`` passes none).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.nn.functional as F

from mcore_compat.cpu import redirect_torch
from mcore_compat.patches import megatron_patch

_COMMON = "megatron.core.ssm.gated_delta_net.common"
_GDN = "megatron.core.ssm.gated_delta_net.gdn"
# _GDNBase methods megatron decorates with jit_fuser (torch.compile).
_FUSED = ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")
ACTIVATIONS = ("silu", "swish")


def _not_ported(name: str, value) -> None:
    if value is not None and value is not False:
        raise NotImplementedError(f"mcore_compat.gdn_cpu: {name}={value!r} is not ported to "
                                  f"torch (packed sequences and carried states need fla)")


def causal_conv1d(x, weight, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, cu_seqlens=None, **_):
    """fla's ``fla.modules.convolution.causal_conv1d`` in torch: a depthwise convolution over
    the sequence that sees steps ``t - w + 1 .. t`` (zero before the start), plus ``bias``,
    then ``activation``, plus ``residual``.

    Args:
        x: ``[b, s, d]``; weight: ``[d, w]``; bias: ``[d]`` or None; residual: ``[b, s, d]``
            or None; activation: None, ``"silu"`` or ``"swish"`` (the same function).

    Returns:
        ``(y [b, s, d] in x's dtype, None)``: fla's (output, final state) without the state.

    Raises:
        ValueError: another activation.
        NotImplementedError: ``initial_state``, ``output_final_state`` or ``cu_seqlens`` given.
    """
    for name, value in (("initial_state", initial_state),
                        ("output_final_state", output_final_state), ("cu_seqlens", cu_seqlens)):
        _not_ported(name, value)
    if activation not in (None, *ACTIVATIONS):
        raise ValueError(f"causal_conv1d: activation={activation!r}; valid: None, "
                         f"{', '.join(map(repr, ACTIVATIONS))} (fla's)")
    d, w = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=w - 1, groups=d)
    y = y[..., :x.shape[1]].transpose(1, 2)
    if activation is not None:
        y = F.silu(y)
    if residual is not None:
        y = y + residual
    return y.to(x.dtype), None


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None):
    """fla's ``fla.modules.l2norm.l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dim,
    computed in fp32 (fp64 for fp64 ``x``).

    Args:
        x: any float tensor; dim: must be the last; eps: added to the sum of squares;
            output_dtype: the result's dtype (None: ``x``'s).

    Raises:
        ValueError: ``dim`` is not the last dimension (fla normalizes the last only).
    """
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"l2norm: dim={dim}; fla normalizes the last dimension only")
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **_):
    """fla's ``chunk_gated_delta_rule`` signature on megatron's
    ``common.torch_chunk_gated_delta_rule`` (chunks of 64 steps, fp32): per head, with
    ``q`` scaled by ``1/sqrt(K)``, ``S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t)
    S_{t-1}^T k_t)^T`` and ``o_t = S_t^T q_t``.

    Args:
        q, k: ``[b, s, h, K]``; v: ``[b, s, h, V]``; g (log decay), beta: ``[b, s, h]``;
            use_qk_l2norm_in_kernel: normalize ``q`` and ``k`` first (:func:`l2norm`).

    Returns:
        ``(o [b, s, h, V] in q's dtype, None)``.

    Raises:
        NotImplementedError: ``scale`` other than ``1/sqrt(K)``, ``initial_state``,
            ``output_final_state`` or ``cu_seqlens`` given.
    """
    if scale is not None and scale != 1 / q.shape[-1] ** 0.5:
        raise NotImplementedError(f"mcore_compat.gdn_cpu: scale={scale!r} is not ported "
                                  f"(megatron's torch kernel scales by 1/sqrt(K))")
    for name, value in (("initial_state", initial_state),
                        ("output_final_state", output_final_state), ("cu_seqlens", cu_seqlens)):
        _not_ported(name, value)
    common = importlib.import_module(_COMMON)
    return common.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fla_usable() -> bool:
    """Whether flash-linear-attention's kernels can run here: CUDA, and ``fla`` importable."""
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return False
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return False
    return True


@megatron_patch("ssm.gated_delta_net.common and .gdn: HAVE_FLA, causal_conv1d, l2norm, "
                "chunk_gated_delta_rule; _GDNBase._apply_gated_norm, "
                "_prepare_input_for_gated_delta_rule, _compute_g_and_beta (jit_fuser); "
                "common's module-global torch")
def install() -> bool:
    """Install the torch functions into megatron's GatedDeltaNet modules (idempotent).

    Returns:
        True when they are installed (now or before), False when fla is usable and megatron
        keeps its own kernels.

    Raises:
        RuntimeError: megatron-core is not the supported version (the gate).
    """
    common, gdn = importlib.import_module(_COMMON), importlib.import_module(_GDN)
    if getattr(common, "_mcore_compat_kernels", False):
        return True
    if common.HAVE_FLA or fla_usable():
        return False
    for module in (common, gdn):
        for name, fn in (("causal_conv1d", causal_conv1d), ("l2norm", l2norm),
                         ("chunk_gated_delta_rule", chunk_gated_delta_rule)):
            if hasattr(module, name):  # gdn imported two of the three
                setattr(module, name, fn)
    common.HAVE_FLA = True  # read by _GDNBase.__init__ only
    for name in _FUSED:
        fused = getattr(common._GDNBase, name)
        setattr(common._GDNBase, name, getattr(fused, "__wrapped__", fused))
    if not torch.cuda.is_available():
        redirect_torch([_COMMON])
    common._mcore_compat_kernels = True
    return True
