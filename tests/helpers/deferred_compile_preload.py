"""Imported first by the test forkserver (``multiproc.PRELOAD``): defers megatron-core's
import-time ``torch.compile`` (``mcore_compat.lazy_compile.install_if_supported``) before the
preload imports megatron, as a training process does before it imports megatron (``python -m
recipes.run.worker``), so each rank forked from the server runs with the same deferred fusions."""

from mcore_compat import lazy_compile

lazy_compile.install_if_supported()
