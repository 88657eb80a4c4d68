"""GatedDeltaNet's ``out_norm`` for the family's local spec: megatron's ``WrappedTorchNorm``
(torch's ``RMSNorm`` or ``LayerNorm``, the same ``weight`` and ``bias`` keys) whose parameters'
gradients are summed over the tensor-parallel group.

``GatedDeltaNet`` normalizes each value head with one ``out_norm`` of ``linear_value_head_dim``
channels, held whole on every TP rank, while each rank holds its own heads: a rank's gradient of
``out_norm`` is the sum over its heads only. megatron-core 0.19.2 sums such gradients over TP
only for sequence-parallel norms and q/k layer norms (``finalize_model_grads``:
``_allreduce_non_tensor_model_parallel_grads``), so at tp > 1 without sequence parallelism each
rank would step ``out_norm`` with its own partial gradient and the copies would drift apart.
Here the weight goes through megatron's ``copy_to_tensor_model_parallel_region`` (identity
forward, all-reduce of the gradient): every rank gets the gradient of all heads, the tp1 one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


class _SummedRMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class _SummedLayerNorm(torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight)
        bias = None if self.bias is None else copy_to_tensor_model_parallel_region(self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class TPSummedNorm:
    """Built as megatron's ``WrappedTorchNorm`` (``config``, ``hidden_size``, ``eps``): torch's
    ``RMSNorm`` or ``LayerNorm`` (``config.normalization``) over ``hidden_size`` channels, its
    forward the same, its parameters' gradients all-reduced over the TP group.

    Raises:
        ValueError: ``config.normalization`` is neither ``RMSNorm`` nor ``LayerNorm``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norms = {"RMSNorm": _SummedRMSNorm, "LayerNorm": _SummedLayerNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization={config.normalization!r}: GatedDeltaNet's out_norm "
                             f"is one of {sorted(norms)} here")
        return norms[config.normalization](hidden_size, eps=eps)
