"""Run megatron-core 0.19.2 on machines without CUDA.

megatron-core assumes a CUDA device in a handful of places that the CPU path of a run still
reaches (``docs/cpu-compat.md`` lists each and why). Instead of editing megatron, :func:`install`
replaces the module-global name ``torch`` inside the affected megatron modules with
:class:`_CpuTorch`, a thin proxy that forwards everything to the real ``torch`` except:

* tensor factories (``torch.tensor``, ``zeros``, ``empty``, ...) called with ``device='cuda'``
  get ``device='cpu'``;
* ``torch.cuda`` is a stand-in whose ``current_device()`` answers ``'cpu'``, whose
  ``synchronize()`` and streams are no-ops, and whose RNG calls use the CPU generator.

Nothing changes when CUDA is available: :func:`install` returns without patching.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.utils import to_local_if_dtensor

from mcore_compat.patches import megatron_patch

# megatron modules whose module-global ``torch`` is replaced, with the calls that need it.
PATCHED_MODULES: dict[str, str] = {
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor: device=torch.cuda.current_device()",
    "megatron.core.distributed.param_and_grad_buffer": (
        "_ParamAndGradBuffer: grad buffers on current_device(); start_grad_sync: current_stream()"
    ),
    "megatron.core.distributed.distributed_data_parallel": "DDP: current_device(), streams",
    "megatron.core.distributed.finalize_model_grads": "finalize_model_grads: token count on cuda",
    "megatron.core.optimizer.optimizer": "FP32Optimizer.__init__: torch.tensor(device='cuda')",
    "megatron.core.optimizer.distrib_optimizer": (
        "DistributedOptimizer: buffers on current_device() (get_parameter_state_dp_zero...)"
    ),
    "megatron.core.optimizer.layer_wise_optimizer": (
        "LayerWiseDistributedOptimizer.has_grad_norm_group: torch.tensor(device='cuda')"
    ),
    "megatron.core.optimizer.clip_grads": (
        "get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32: device='cuda'"
    ),
    "megatron.core.tensor_parallel.random": (
        "model_parallel_cuda_manual_seed and CudaRNGStatesTracker: CUDA generator state"
    ),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "preload_tensors: synchronize()",
    "megatron.core.dist_checkpointing.strategies.async_utils": "current_device()",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "current_device()",
    "megatron.core.dist_checkpointing.exchange_utils": "current_device()",
    "megatron.core.transformer.utils": "get_default_causal_mask: torch.ones(device=\"cuda\")",
    "megatron.core.pipeline_parallel.schedules": "forward_backward_no_pipelining: cuda tensors",
    "megatron.core.pipeline_parallel.p2p_communication": (
        "P2PCommunicator._communicate: receive buffers and shape tensors on current_device(); "
        "synchronize()"
    ),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        "RotaryEmbedding.get_emb (RoPE): inv_freq.to(torch.cuda.current_device())"
    ),
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": (
        "YarnRotaryEmbedding.get_emb (multi-latent attention's YaRN): "
        "inv_freq_extra / inv_freq_inter .to(torch.cuda.current_device())"
    ),
    "megatron.core.transformer.multi_token_prediction": (
        "MTPLossLoggingHelper.save_metrics_to_tracker: torch.zeros(device=current_device())"
    ),
    "megatron.core.tensor_parallel.generalized_tensor_parallelism": (
        "wait_for_gtp_grad_reduction_on_current_stream (finalize_model_grads under GTP): "
        "current_stream(); GTPShardedParam AG/RS streams and events"
    ),
}

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like",
              "ones_like", "full_like", "randn", "rand")


def _cpu_device(device):
    """Map a CUDA device spec (``'cuda'``, ``'cuda:0'``, an int, a ``torch.device``) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _NullStream:
    """A CUDA stream stand-in: every operation completes immediately on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def query(self):
        return True


class _NullEvent(_NullStream):
    """A CUDA event stand-in."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def elapsed_time(self, other):
        return 0.0


class _CpuCuda(types.SimpleNamespace):
    """Stand-in for ``torch.cuda`` inside patched megatron modules."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _make_cpu_cuda() -> _CpuCuda:
    rng = types.SimpleNamespace(
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        manual_seed=torch.manual_seed,
    )
    return _CpuCuda(
        is_available=lambda: False,
        current_device=lambda: "cpu",
        device_count=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        Stream=_NullStream,
        Event=_NullEvent,
        stream=lambda *a, **k: contextlib.nullcontext(),
        device=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda: None,
                                   range=lambda *a, **k: contextlib.nullcontext()),
        get_rng_state=torch.get_rng_state,
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        default_generators=(torch.default_generator,),
        random=rng,
        is_current_stream_capturing=lambda: False,
        max_memory_allocated=lambda *a, **k: 0,
        memory_allocated=lambda *a, **k: 0,
    )


class _CpuTorch(types.ModuleType):
    """Proxy for the ``torch`` module that redirects CUDA device requests to CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cpu_cuda()
        for name in _FACTORIES:
            setattr(self, name, self._redirect(getattr(torch, name)))

    @staticmethod
    def _redirect(fn):
        def wrapper(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = f"{fn.__name__} with CUDA devices mapped to CPU (mcore_compat.cpu)."
        return wrapper

    def __getattr__(self, name):
        return getattr(torch, name)


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    """CPU twin of ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator's state."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    """CPU twin of ``tensor_parallel.random._set_cuda_rng_state``.

    The original defers through ``torch.cuda._lazy_call``, which never runs without CUDA, so the
    RNG tracker's ``fork()`` would silently keep one stream; here it sets the CPU generator.
    """
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU twin of ``optimizer.clip_grads.clip_grad_by_total_norm_fp32``.

    Same math (scale every grad by ``max_norm / (total_norm + 1e-6)`` when that is below 1);
    the original asserts ``grad.type() == 'torch.cuda.FloatTensor'``, which no CPU grad passes.

    Raises:
        TypeError: a grad is not fp32/bf16 (decoupled) or not fp32 (regular), as upstream asserts.
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    grads = []
    for param in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
        grad = getattr(param, attr, None)
        if grad is None:
            continue
        if grad.dtype not in allowed:
            raise TypeError(f"clip_grad_by_total_norm_fp32: grad dtype {grad.dtype} not in {allowed}")
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


class _DropCpuRngWarning(logging.Filter):
    """``CudaRNGStatesTracker.fork`` warns when the CPU RNG changes inside a fork; on CPU the
    forked generator *is* the CPU generator, so the warning is expected and only noise."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    """While active, ``tensor.type()`` (no argument) of a CPU float tensor answers the CUDA
    name, e.g. ``'torch.cuda.BFloat16Tensor'``; everything else is unchanged."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_float16_optimizer_init():
    """``Float16OptimizerWithFloat16Params.__init__`` and ``DistributedOptimizer.__init__``
    (``_build_model_and_main_param_groups``) sort params by ``param.type()`` and accept only
    ``torch.cuda.{Half,BFloat16,Float}Tensor``; run them with CPU tensors reporting those
    names, so bf16 runs and the distributed optimizer get megatron's fp32 main params on CPU too."""
    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        original = cls.__init__

        def __init__(self, *args, _original=original, **kwargs):
            with _cpu_tensors_report_cuda_types():
                _original(self, *args, **kwargs)

        __init__.__wrapped__ = original
        cls.__init__ = __init__


@contextlib.contextmanager
def tensor_cuda_returns_self():
    """While active, ``tensor.cuda()`` returns the CPU tensor itself."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda t, *args, **kwargs: t
    try:
        yield
    finally:
        torch.Tensor.cuda = original


# Methods that move a tensor with ``tensor.cuda()`` (a Tensor method, out of reach of the module
# proxy), run with ``tensor.cuda()`` returning the CPU tensor.
TENSOR_CUDA_METHODS = {
    "megatron.core.models.common.language_module.language_module.LanguageModule."
    "setup_embeddings_and_output_layer": "tied embedding/output weight before its PP all-reduce",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero":
        "distributed optimizer shards gathered for the fully_reshardable checkpoint format",
}


def _run_output_gate_eagerly():
    """``Attention._apply_output_gate`` (gated attention's ``x * sigmoid(gate)``) uncompiled:
    megatron decorates it with ``jit_fuser`` (``torch.compile``), which on CPU builds C++
    kernels with Inductor at its first call in every process (the same math, eagerly)."""
    from megatron.core.transformer.attention import Attention

    fused = Attention._apply_output_gate
    Attention._apply_output_gate = getattr(fused, "__wrapped__", fused)


def _patch_tensor_cuda_methods():
    for path in TENSOR_CUDA_METHODS:
        module_name, cls_name, method = path.rsplit(".", 2)
        cls = getattr(importlib.import_module(module_name), cls_name)
        original = getattr(cls, method)

        def wrapper(*args, _original=original, **kwargs):
            with tensor_cuda_returns_self():
                return _original(*args, **kwargs)

        wrapper.__wrapped__ = original
        wrapper.__name__ = method
        setattr(cls, method, wrapper)


def _patch_rng_state_functions():
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())
    random._get_cuda_rng_state = _get_cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state


_INSTALLED = False


@megatron_patch("the module-global torch of PATCHED_MODULES, tensor_parallel.random."
                "_get/_set_cuda_rng_state, clip_grads.clip_grad_by_total_norm_fp32, "
                "Float16OptimizerWithFloat16Params.__init__, torch.Tensor.cuda methods, "
                "transformer.attention.Attention._apply_output_gate (jit_fuser)")
def install(force: bool = False) -> bool:
    """Redirect megatron-core's CUDA-only calls to CPU when CUDA is unavailable.

    Args:
        force: patch even when CUDA is available (tests only).

    Returns:
        True when the patch is active after the call, False when CUDA is available and nothing
        was patched.

    Raises:
        ImportError: a module in :data:`PATCHED_MODULES` is missing (wrong megatron-core version).
    """
    global _INSTALLED
    if not _INSTALLED and needs_cpu_patches(force):
        redirect_torch(PATCHED_MODULES)
        _patch_rng_state_functions()
        _patch_float16_optimizer_init()
        _patch_tensor_cuda_methods()
        _run_output_gate_eagerly()
        for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
            importlib.import_module(name).clip_grad_by_total_norm_fp32 = (
                _clip_grad_by_total_norm_fp32_cpu
            )
        _INSTALLED = True
    return _INSTALLED


def is_installed() -> bool:
    """Whether :func:`install` has patched megatron-core in this process."""
    return _INSTALLED


def needs_cpu_patches(force: bool = False) -> bool:
    """Whether an ``install(force)`` of CPU patches should patch: CUDA is unavailable, or
    ``force`` (tests). Each installer also keeps its own flag so that it patches once."""
    return force or not torch.cuda.is_available()


@megatron_patch("the module-global torch of the named megatron modules")
def redirect_torch(module_names) -> None:
    """Replace the module-global ``torch`` of each megatron module named in ``module_names``
    (an iterable of import paths) with a proxy that maps CUDA devices to CPU (:class:`_CpuTorch`).

    Raises:
        ImportError: a module named is missing (wrong megatron-core version)."""
    proxy = _CpuTorch()
    for name in module_names:
        importlib.import_module(name).torch = proxy
