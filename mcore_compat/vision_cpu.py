"""megatron-core 0.19.2's CLIP vision encoder and LLaVA model without TransformerEngine and
without CUDA.

:func:`install` fixes the three places that stop them (each measured on megatron-core 0.19.2,
CPU, gloo):

* ``CLIPViTModel.__init__``'s norm default: without TransformerEngine ``NORM_IMPL`` is
  ``torch.nn.LayerNorm``, which megatron's ``build_module`` calls with ``config=`` (a
  ``TypeError`` on any machine without TransformerEngine, GPU or not). A ``torch.nn.LayerNorm``
  given as ``ln_pre_impl`` / ``ln_post_impl`` (the default) becomes megatron's
  ``WrappedTorchNorm``: the same ``weight`` / ``bias`` keys. ``LLaVAModel`` passes no norm.
* without CUDA, ``CLIPViTModel.__init__`` moves its ``position_ids`` with ``tensor.cuda()``:
  run with ``tensor.cuda()`` returning the CPU tensor (``mcore_compat.cpu``'s mechanism).
* without CUDA, ``LLaVAModel``'s forward asks ``torch.cuda.current_device()`` on every call (its
  no-audio branch): the module's ``torch`` becomes the CPU proxy of ``mcore_compat.cpu``.
"""

from __future__ import annotations

import megatron.core.models.multimodal.llava_model as llava_model
import megatron.core.models.vision.clip_vit_model as clip_vit_model
import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mcore_compat.cpu import redirect_torch, tensor_cuda_returns_self
from mcore_compat.patches import megatron_patch


def _norm(impl):
    return WrappedTorchNorm if impl is torch.nn.LayerNorm else impl


@megatron_patch("models.vision.clip_vit_model.CLIPViTModel.__init__ (its no-TE norm default and "
                "tensor.cuda()), models.multimodal.llava_model's module-global torch")
def install() -> None:
    """Make ``CLIPViTModel`` and ``LLaVAModel`` buildable without TransformerEngine and runnable
    without CUDA (idempotent; the CUDA parts only where CUDA is unavailable).

    Raises:
        RuntimeError: megatron-core is not the supported version (the gate).
    """
    cls = clip_vit_model.CLIPViTModel
    if getattr(cls.__init__, "_mcore_compat", False):
        return
    original = cls.__init__
    on_cpu = not torch.cuda.is_available()

    def __init__(self, transformer_config, transformer_layer_spec,
                 ln_pre_impl=clip_vit_model.NORM_IMPL, ln_post_impl=clip_vit_model.NORM_IMPL,
                 *args, **kwargs):
        args = (self, transformer_config, transformer_layer_spec, _norm(ln_pre_impl),
                _norm(ln_post_impl), *args)
        if not on_cpu:
            return original(*args, **kwargs)
        with tensor_cuda_returns_self():
            return original(*args, **kwargs)

    __init__._mcore_compat = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__
    if on_cpu:
        redirect_torch([llava_model.__name__])
