"""The registry of every megatron-core patch this repository installs, each behind the version
gate (:func:`mcore_compat.version.check_megatron_version`).

A patch is a function that replaces or writes megatron-core internals; it is declared with
:func:`megatron_patch`, which records it in :data:`PATCHES` at import and checks the gate each
time it is called, before the patch's body runs. ``docs/cpu-compat.md`` lists what each patches;
``tests/test_megatron_patches.py`` checks that every one goes through the gate.
"""

from __future__ import annotations

import functools

from mcore_compat.version import check_megatron_version, installed_megatron_version

# "module.function" -> the megatron functions or state it patches (for the gate's message).
PATCHES: dict[str, str] = {}


def megatron_patch(patches: str):
    """Decorate a function that patches megatron-core internals.

    Args:
        patches: what it patches, naming megatron's module and function or state, e.g.
            ``"dist_checkpointing.strategies.filesystem_async._results_queue"``.

    Returns:
        A decorator: the function is registered in :data:`PATCHES` under
        ``"<module>.<name>"`` and, on every call, first checks that the installed megatron-core
        is the supported one (``RuntimeError`` otherwise, naming ``patches``).
    """
    def decorate(fn):
        name = f"{fn.__module__}.{fn.__qualname__}"
        PATCHES[name] = patches

        @functools.wraps(fn)
        def gated(*args, **kwargs):
            check_megatron_version(installed_megatron_version(), f"{name} patches {patches}")
            return fn(*args, **kwargs)

        gated.megatron_patch = patches
        return gated

    return decorate
