"""The one megatron-core version whose internals the patches of gtp/ and mcore_compat/ were
written against."""

from __future__ import annotations

import sys
from importlib.metadata import version

SUPPORTED_MEGATRON_VERSION = "0.19.2"


def check_megatron_version(version: str, patched: str = "gtp/ patches megatron-core internals") -> None:
    """Raise ``RuntimeError`` unless ``version`` (local suffix such as ``+abc123`` ignored) is
    :data:`SUPPORTED_MEGATRON_VERSION`.

    Args:
        version: megatron-core's version string.
        patched: what the caller patches, for the message.
    """
    from packaging.version import Version

    if Version(version).base_version != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"{patched} (written for megatron-core {SUPPORTED_MEGATRON_VERSION}); found "
            f"megatron-core {version}. Re-check the patched functions against this version "
            "before extending the gate."
        )


def installed_megatron_version() -> str:
    """megatron-core's version: ``megatron.core.__version__`` once it is imported, otherwise the
    installed distribution's, so that a patch that must run before megatron is imported
    (:func:`mcore_compat.lazy_compile.install`) is gated without importing it.

    Raises:
        importlib.metadata.PackageNotFoundError: megatron-core is neither imported nor installed.
    """
    core = sys.modules.get("megatron.core")
    if core is not None:
        return core.__version__

    return version("megatron-core")
