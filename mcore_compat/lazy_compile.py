"""``torch.compile`` deferred to the first call while megatron-core is imported.

megatron-core 0.19.2 sets ``megatron.core.jit.jit_fuser = torch.compile`` and decorates its
fusions with it at import, as ``emerging_optimizers`` (which ``megatron.core.optimizer``
imports) does its scalar updates and ``megatron.core.transformer.moe.router`` one method.
``torch.compile(fn)`` compiles nothing until ``fn`` is called, but it imports TorchDynamo and
Inductor at once: about a third of the time a training process spends importing, on every
rank, for functions that a CPU run never calls. Here the decoration returns a stand-in that
calls ``torch.compile(fn, **options)`` on its first call and delegates to the result: the same
compiled function, compiled at the same moment (the first call), so nothing changes but when
Dynamo is imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys

from mcore_compat.patches import megatron_patch

# The packages whose import-time ``torch.compile`` is deferred (their submodules included).
DEFERRED_PACKAGES = ("megatron.core", "emerging_optimizers")


def lazy_compile(model=None, **options):
    """``torch.compile`` with the compile (and the import of Dynamo) deferred to the first call.

    Args:
        model: a function, or an ``nn.Module`` (compiled at once by ``torch.compile``, which
            wraps modules in an ``OptimizedModule`` whose type callers may check), or None for
            the decorator-factory form ``@torch.compile(mode=...)``.
        **options: ``torch.compile``'s keyword arguments, passed unchanged.

    Returns:
        A function with ``model``'s name and docstring that, on its first call, compiles
        ``model`` with the real ``torch.compile`` and from then on calls the compiled function.
    """
    import torch

    if model is None:
        return lambda fn: lazy_compile(fn, **options)
    if isinstance(model, torch.nn.Module):
        return _REAL_COMPILE[0](model, **options)
    compiled = []

    @functools.wraps(model)
    def first_call_compiles(*args, **kwargs):
        if not compiled:
            compiled.append(_REAL_COMPILE[0](model, **options))
        return compiled[0](*args, **kwargs)

    return first_call_compiles


# torch.compile as torch defines it, saved by the first deferring import.
_REAL_COMPILE: list = []


class _DeferringLoader:
    """Runs a module of :data:`DEFERRED_PACKAGES` with ``torch.compile`` set to
    :func:`lazy_compile`, then puts back what was there; every other attribute is the wrapped
    loader's (``get_source``, ``get_resource_reader``)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        before = torch.compile
        if not _REAL_COMPILE:
            _REAL_COMPILE.append(before)
        torch.compile = lazy_compile
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = before


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds a module of :data:`DEFERRED_PACKAGES` with the finders after it on
    ``sys.meta_path`` and wraps its loader in :class:`_DeferringLoader`."""

    def find_spec(self, fullname, path, target=None):
        if not any(fullname == p or fullname.startswith(p + ".") for p in DEFERRED_PACKAGES):
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def is_installed() -> bool:
    """Whether :func:`install` has put its finder on ``sys.meta_path``."""
    return any(isinstance(f, _DeferringFinder) for f in sys.meta_path)


@megatron_patch("megatron.core.jit.jit_fuser and the import-time torch.compile of megatron.core "
                "and emerging_optimizers (deferred to the first call)")
def install() -> None:
    """Defer the import-time ``torch.compile`` of megatron-core to the first call of each
    compiled function (:func:`lazy_compile`), for the modules imported after this call.

    Call it before ``megatron.core`` is imported; a module already imported keeps its
    ``torch.compile``. Idempotent.

    Raises:
        RuntimeError: the installed megatron-core is not the supported version (the gate).
    """
    if not is_installed():
        sys.meta_path.insert(0, _DeferringFinder())
