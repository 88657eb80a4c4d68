"""Narrow, version-gated shims for megatron-core, below both ``gtp/`` and ``recipes/``.

* :mod:`mcore_compat.version` - the one megatron-core version whose internals the patches of
  this repository were written against (:func:`~mcore_compat.version.check_megatron_version`).
* :mod:`mcore_compat.cpu` - redirects megatron-core's CUDA-only calls to CPU on machines
  without CUDA (:func:`~mcore_compat.cpu.install`).
* :mod:`mcore_compat.patches` - the registry of every megatron patch of this repository;
  :func:`~mcore_compat.patches.megatron_patch` declares one and checks the version gate first.
* :mod:`mcore_compat.lazy_compile` - megatron-core's import-time ``torch.compile`` deferred to
  each function's first call (:func:`~mcore_compat.lazy_compile.install`).
* :mod:`mcore_compat.dist_checkpointing` - the torch_dist writers' results queue
  (:func:`~mcore_compat.dist_checkpointing.set_write_results_queue`).

Imports nothing from ``gtp/`` or ``recipes/``; see ``docs/cpu-compat.md``.
"""
