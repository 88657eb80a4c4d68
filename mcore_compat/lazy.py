"""Names of a package whose modules import torch or megatron, loaded on first use (PEP 562):
``train.py`` imports those packages before launch, where start-up time counts."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, lazy: dict):
    """The ``__getattr__`` of ``package`` for ``lazy`` (``{submodule: (name, ...)}``): a
    submodule's name gives the submodule, one of its names the value, kept in the package's
    namespace after the first use.

    Raises (from the returned function):
        AttributeError: a name neither in ``lazy`` nor in the package.
    """
    home = {name: module for module, names in lazy.items() for name in names}

    def __getattr__(name: str):
        if name in lazy:
            return importlib.import_module(f"{package}.{name}")
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
