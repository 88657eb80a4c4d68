"""megatron's ``layernorm_zero_centered_gamma`` for its local norm (``WrappedTorchNorm``).

With ``layernorm_zero_centered_gamma`` megatron's fused and TransformerEngine norms compute
``norm(x) * (1 + weight)`` with ``weight`` starting at 0 (``FusedLayerNorm``, ``TENorm``:
``zero_centered_gamma``); megatron-core 0.19.2's ``WrappedTorchNorm`` (torch's ``RMSNorm``, the
local spec's norm, and the hybrid stack's final norm here) asserts the field is false.
Qwen3-Next's every RMSNorm but GatedDeltaNet's gated one is zero-centred (transformers'
``Qwen3NextRMSNorm``: fp32 ``x / rms(x) * (1 + weight)``), so an imported model keeps its
``weight`` as it is (an export gives the same bits back) and this norm computes what
transformers does.

:func:`install` makes ``WrappedTorchNorm(config, ...)`` build :class:`ZeroCenteredRMSNorm`
when ``config.layernorm_zero_centered_gamma`` (``normalization`` RMSNorm only; LayerNorm
raises), megatron's own class otherwise. Its weight carries ``sequence_parallel`` from the
config, as megatron's own norms' do, whichever of this patch and
``mcore_compat.moe_cpu.torch_norm_under_sequence_parallel`` wraps the other.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from mcore_compat.patches import megatron_patch

_TORCH_NORM = "megatron.core.transformer.torch_norm"


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in fp32, cast back to ``x``'s dtype
    (megatron's ``zero_centered_gamma``; transformers' ``Qwen3NextRMSNorm``). ``weight``
    ``[hidden_size]`` starts at 0 (the identity scale)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float() + 1.0,
                          self.eps).type_as(x)


@megatron_patch("transformer.torch_norm.WrappedTorchNorm.__new__ (layernorm_zero_centered_gamma)")
def install() -> None:
    """Make megatron's ``WrappedTorchNorm`` build :class:`ZeroCenteredRMSNorm` when its config
    has ``layernorm_zero_centered_gamma`` (idempotent; megatron's behaviour otherwise).

    Raises:
        RuntimeError: megatron-core is not the supported version (the gate).
        ValueError (when such a norm is built): ``normalization`` other than RMSNorm.
    """
    wrapped = importlib.import_module(_TORCH_NORM).WrappedTorchNorm
    if getattr(wrapped, "_mcore_compat_zero_centered", False):
        return
    original = wrapped.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not getattr(config, "layernorm_zero_centered_gamma", False):
            return original(cls, config, hidden_size, eps, **kwargs)
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r} with "
                             f"layernorm_zero_centered_gamma: only RMSNorm here")
        norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():  # as megatron's own norms: summed over TP under SP
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm

    wrapped.__new__ = staticmethod(new)
    wrapped._mcore_compat_zero_centered = True
