"""Run megatron-core 0.19.2's Mixture of Experts and sequence parallelism on CPU (gloo).

:mod:`mcore_compat.cpu` covers the dense path; MoE layers, their token dispatchers and
sequence parallelism reach a few more CUDA-only calls. :func:`install` patches each narrowly
(``docs/cpu-compat.md``, "MoE and sequence parallelism"); nothing changes when CUDA is available.

=========================================================================  ======================
megatron-core 0.19.2 function                                              fix
=========================================================================  ======================
``transformer.moe.router.Router.gating`` (``weight.to(current_device())``)  module ``torch`` proxy
``transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__``    module ``torch`` proxy
(``torch.cuda.Stream()``)
``tensor_parallel.mappings._gather_along_first_dim`` /                      module ``torch`` proxy
``_reduce_scatter_along_first_dim`` (``torch.empty(device=cuda)``)
``tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication    module ``torch`` proxy
.backward``, sequence-parallel branch (``torch.empty(device=cuda)``)
``transformer.moe.moe_utils.maybe_move_tensor_to_cpu`` (as token_dispatcher  CPU tensors to numpy
imported it): converts CUDA tensors only, so CPU split sizes stay tensors
and ``all_to_all_single`` raises ``TypeError``
``tensor_parallel.mappings._gather_along_first_dim`` with                   pad, gather, cut
``output_split_sizes``: gloo's ``all_gather`` needs equal sizes
``transformer.torch_norm.WrappedTorchNorm.__new__`` asserts no sequence     build without, tag
parallelism                                                                 ``sequence_parallel``
=========================================================================  ======================

The norm fix tags the norm's params ``sequence_parallel = True`` as megatron's fused norms do, so
``finalize_model_grads`` sums their gradients over the tensor-parallel group (each TP rank saw
only its share of the sequence); without the tag norm gradients are wrong. It is the one patch
here that holds with CUDA too (:func:`torch_norm_under_sequence_parallel`, which the hybrid
family installs on any device).
"""

from __future__ import annotations

import copy
import importlib

import torch

from mcore_compat.cpu import needs_cpu_patches, redirect_torch
from mcore_compat.patches import megatron_patch

# Modules whose module-global ``torch`` becomes mcore_compat.cpu's CPU proxy, with the call.
PATCHED_MODULES: dict[str, str] = {
    "megatron.core.transformer.moe.router": "Router.gating: weight.to(torch.cuda.current_device())",
    "megatron.core.transformer.moe.token_dispatcher": (
        "MoEAlltoAllTokenDispatcher.__init__: torch.cuda.Stream()"),
    "megatron.core.tensor_parallel.mappings": (
        "_gather_along_first_dim / _reduce_scatter_along_first_dim: "
        "torch.empty(..., device=torch.cuda.current_device())"),
    "megatron.core.tensor_parallel.layers": (
        "LinearWithGradAccumulationAndAsyncCommunication.backward (sequence parallel): "
        "torch.empty(..., device=torch.cuda.current_device())"),
}

_INSTALLED = False


def _is_gloo(group) -> bool:
    return "gloo" in str(torch.distributed.get_backend(group)).lower()


def _patch_uneven_gather(mappings) -> None:
    """``mappings._gather_along_first_dim(..., output_split_sizes=...)`` on gloo: every piece
    padded to the largest, all-gathered, the padding cut off (same result as megatron's unequal
    ``all_gather``, which gloo refuses: "invalid tensor size")."""
    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]].copy_(input_)
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    _gather_along_first_dim.__wrapped__ = original
    mappings._gather_along_first_dim = _gather_along_first_dim


def _patch_split_sizes(token_dispatcher) -> None:
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` as ``MoEAlltoAllTokenDispatcher`` calls
    it: a CPU tensor becomes numpy too (megatron converts CUDA tensors only)."""
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__wrapped__ = original
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


@megatron_patch("transformer.torch_norm.WrappedTorchNorm.__new__ (asserts no sequence "
                "parallelism)")
def torch_norm_under_sequence_parallel() -> None:
    """``WrappedTorchNorm.__new__`` under sequence parallelism: the torch norm is built from a
    copy of the config with ``sequence_parallel`` off, and its params are tagged
    ``sequence_parallel`` (megatron's ``FusedLayerNorm`` does the same), so that
    ``finalize_model_grads`` sums their gradients over the TP group. Idempotent; with CUDA too
    (:func:`install` calls it on CPU; the hybrid family, whose local spec builds this norm
    where apex is missing and for every Mamba layer, on any device). Without sequence
    parallelism the norm is megatron's, untagged."""
    cls = importlib.import_module("megatron.core.transformer.torch_norm").WrappedTorchNorm
    if getattr(cls, "_mcore_compat_sequence_parallel", False):
        return  # a class flag: another patch may wrap this one's __new__ (zero_centered_norm)
    original = cls.__new__

    def __new__(klass, config, hidden_size, eps=1e-5, **kwargs):
        sp = bool(config.sequence_parallel)
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original(klass, config, hidden_size, eps, **kwargs)
        if sp:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    __new__.__wrapped__ = original
    cls.__new__ = __new__
    cls._mcore_compat_sequence_parallel = True


@megatron_patch("the module-global torch of PATCHED_MODULES (MoE router, token dispatchers, "
                "mappings), tensor_parallel.mappings' uneven gather, moe token_dispatcher split "
                "sizes, transformer.torch_norm.WrappedTorchNorm")
def install(force: bool = False) -> bool:
    """Apply the patches of this module's table (idempotent).

    Args:
        force: patch even when CUDA is available (tests only).

    Returns:
        True when the patches are active after the call, False when CUDA is available.

    Raises:
        RuntimeError: megatron-core is not the version these patches were written for.
    """
    global _INSTALLED
    if not _INSTALLED and needs_cpu_patches(force):
        redirect_torch(PATCHED_MODULES)
        _patch_uneven_gather(importlib.import_module("megatron.core.tensor_parallel.mappings"))
        _patch_split_sizes(
            importlib.import_module("megatron.core.transformer.moe.token_dispatcher"))
        torch_norm_under_sequence_parallel()
        _INSTALLED = True
    return _INSTALLED


def is_installed() -> bool:
    """Whether :func:`install` has patched megatron-core in this process."""
    return _INSTALLED
