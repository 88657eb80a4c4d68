"""megatron-core 0.19.2's ``MambaMixer`` without ``mamba_ssm``: the plain-torch kernels of
:mod:`mcore_compat.mamba_ops` installed where megatron looks for mamba_ssm's.

Without CUDA, ``mamba_ssm`` does not import (its ``__init__`` loads the CUDA extension) and its
Triton kernels reject CPU tensors, so ``megatron.core.ssm.mamba_mixer`` sets
``HAVE_MAMBA_SSM = False``, makes ``RMSNormGated`` a ``MagicMock`` and ``MambaMixer(...)``
raises ``ImportError: MambaSSM is not installed``. :func:`install` (only where ``mamba_ssm`` is
missing; with it, megatron's own path is left alone) replaces, in that module:

* ``mamba_split_conv1d_scan_combined`` and ``mamba_chunk_scan_combined`` with
  :mod:`mcore_compat.mamba_ops`' (the training and the prefill path);
* ``RMSNormGated`` and ``ExtendedRMSNorm`` with :class:`RMSNormGated` /
  :class:`ExtendedRMSNorm` (mamba_ssm's gated RMSNorm module, its ``weight`` key, and megatron's
  ``sharded_state_dict`` of it: TP-sharded on dim 0);
* ``HAVE_MAMBA_SSM`` with True;
* on a machine without CUDA, the module's ``torch`` with the CPU proxy of
  :mod:`mcore_compat.cpu` (``MambaMixer.__init__`` allocates conv1d, dt, A, D and the norm on
  ``torch.cuda.current_device()``).

The one-step decode update (``selective_state_update``, inference only) is not replaced.

:func:`hybrid_stack_without_te` lets megatron's ``HybridStack`` build without TransformerEngine:
its final norm is ``TENorm`` whatever the spec says.
"""

from __future__ import annotations

import importlib
import importlib.util

import megatron.core.models.hybrid.hybrid_block as hybrid_block
import megatron.core.ssm.mamba_mixer as mixer
import torch
from megatron.core import parallel_state
from megatron.core.extensions import transformer_engine
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mcore_compat import mamba_ops
from mcore_compat.cpu import redirect_torch
from mcore_compat.patches import megatron_patch


class RMSNormGated(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: RMSNorm over groups of ``group_size``
    channels, optionally gated by ``silu(z)`` (:func:`mcore_compat.mamba_ops.rmsnorm_fn`).

    Args:
        hidden_size: channels ``d``; ``weight`` is ``[d]``, initialised to ones.
        eps: added to the mean square.
        group_size: channels per group (None: all ``d``).
        norm_before_gate: gate after the norm (True) or before it.
        device, dtype: of ``weight``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size=None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z=None) -> torch.Tensor:
        """``x``, ``z``: ``[..., d]``; returns ``[..., d]`` in ``x``'s dtype."""
        return mamba_ops.rmsnorm_fn(x, self.weight, self.bias, z, self.eps, self.group_size,
                                    self.norm_before_gate)


class ExtendedRMSNorm(RMSNormGated):
    """megatron's ``ExtendedRMSNorm`` on :class:`RMSNormGated`: the same sharded state dict
    (``weight`` TP-sharded on dim 0; the body of megatron-core 0.19.2's method, whose class
    cannot be used here: its base is a ``MagicMock``)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``{prefix + "weight": ShardedTensor}``, TP-split on dim 0."""
        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def mamba_ssm_usable() -> bool:
    """Whether ``mamba_ssm``'s kernels can run here: CUDA, and the package importable."""
    if not torch.cuda.is_available() or importlib.util.find_spec("mamba_ssm") is None:
        return False
    try:
        importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError:
        return False
    return True


@megatron_patch("ssm.mamba_mixer: HAVE_MAMBA_SSM, RMSNormGated, ExtendedRMSNorm, "
                "mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined, module-global torch")
def install() -> bool:
    """Install the torch kernels into ``megatron.core.ssm.mamba_mixer`` (idempotent).

    Returns:
        True when they are installed (now or before), False when ``mamba_ssm`` is usable and
        megatron keeps its own kernels.

    Raises:
        RuntimeError: megatron-core is not the supported version (the gate).
    """
    if getattr(mixer, "_mcore_compat_kernels", False):
        return True
    if mixer.HAVE_MAMBA_SSM or mamba_ssm_usable():
        return False
    mixer.mamba_chunk_scan_combined = mamba_ops.mamba_chunk_scan_combined
    mixer.mamba_split_conv1d_scan_combined = mamba_ops.mamba_split_conv1d_scan_combined
    mixer.RMSNormGated = RMSNormGated
    mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mixer.HAVE_MAMBA_SSM = True
    if not torch.cuda.is_available():
        redirect_torch([mixer.__name__])
    mixer._mcore_compat_kernels = True
    return True


@megatron_patch("models.hybrid.hybrid_block.TENorm (HybridStack's final norm)")
def hybrid_stack_without_te() -> None:
    """Where TransformerEngine is not installed, make ``HybridStack``'s final norm megatron's
    ``WrappedTorchNorm`` (torch's LayerNorm or RMSNorm as ``config.normalization``, the same
    ``weight`` key): megatron-core 0.19.2 builds it as ``TENorm`` in every spec, which raises
    ``ImportError`` without TransformerEngine. Idempotent; nothing where TE is installed."""
    if not transformer_engine.HAVE_TE:
        hybrid_block.TENorm = WrappedTorchNorm

