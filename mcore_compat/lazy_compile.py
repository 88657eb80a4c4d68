"""``torch.compile`` deferred to the first call while megatron-core is imported.

megatron-core 0.19.2 sets ``megatron.core.jit.jit_fuser = torch.compile`` and decorates its
fusions with it at import, as ``emerging_optimizers`` (which ``megatron.core.optimizer``
imports) does its scalar updates and ``megatron.core.transformer.moe.router`` one method.
``torch.compile(fn)`` compiles nothing until ``fn`` is called, but it imports TorchDynamo and
Inductor at once: about a third of the time a training process spends importing, on every
rank, for functions that a CPU run never calls. Here the decoration returns a stand-in that
calls ``torch.compile(fn, **options)`` on its first call and delegates to the result: the same
compiled function, compiled at the same moment (the first call). What ``torch.compile`` checks
when it decorates (``mode`` with ``options``, the Python version) is checked at that first call.

While such an import runs, ``torch.compile`` is the stand-in for the whole process, so what that
module imports in turn (TransformerEngine's fusions on a GPU machine) and another thread's
``torch.compile`` are deferred too: the same compiled functions, later.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from importlib.metadata import PackageNotFoundError

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
        For a function, a function with its name and docstring that, on its first call,
        compiles it with the real ``torch.compile`` and from then on calls the compiled
        function; for a module, ``torch.compile``'s ``OptimizedModule``; for None, a decorator.
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
# Deferring imports under way, in any thread: torch.compile is the stand-in while above 0.
_DEPTH = [0]
_DEPTH_LOCK = threading.Lock()


class _DeferringLoader:
    """Runs a module of :data:`DEFERRED_PACKAGES` with ``torch.compile`` set to
    :func:`lazy_compile`, and puts the real one back when the last such import under way, in
    any thread, ends; every other attribute is the wrapped loader's (``get_source``,
    ``get_resource_reader``)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        if name == "_loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        with _DEPTH_LOCK:
            if not _REAL_COMPILE:
                _REAL_COMPILE.append(torch.compile)
            _DEPTH[0] += 1
            torch.compile = lazy_compile
        try:
            self._loader.exec_module(module)
        finally:
            with _DEPTH_LOCK:
                _DEPTH[0] -= 1
                if _DEPTH[0] == 0:
                    torch.compile = _REAL_COMPILE[0]


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds a module of :data:`DEFERRED_PACKAGES` with the finders after it on
    ``sys.meta_path`` and wraps its loader in :class:`_DeferringLoader`."""

    def find_spec(self, fullname, path, target=None):
        if not any(fullname == p or fullname.startswith(p + ".") for p in DEFERRED_PACKAGES):
            return None
        finders = list(sys.meta_path)
        # Called while not on sys.meta_path (a stale copy of it): not this finder's import.
        rest = finders[finders.index(self) + 1:] if self in finders else []
        for finder in rest:
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
        importlib.metadata.PackageNotFoundError: megatron-core is not imported and has no
            package metadata (:func:`install_if_supported` skips the deferral instead).
    """
    if not is_installed():
        sys.meta_path.insert(0, _DeferringFinder())


def install_if_supported() -> bool:
    """:func:`install` where the installed megatron-core is the supported one; nothing elsewhere.

    The deferral only saves start-up time, so a process does not stop for it: an unsupported
    megatron-core, or one whose version is unknown before its import (a source checkout on
    ``PYTHONPATH`` without package metadata), is refused by the patches that change behaviour.

    Returns:
        Whether the deferral is installed.
    """
    try:
        install()  # the gate's refusal, before the body
    except (RuntimeError, PackageNotFoundError):
        return False
    return True
