"""The one write into megatron-core's dist-checkpointing private state: the writers' results
queue of its torch_dist save (``strategies.filesystem_async._results_queue``)."""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies import filesystem_async

from mcore_compat.patches import megatron_patch


@megatron_patch("dist_checkpointing.strategies.filesystem_async._results_queue "
                "(the queue get_write_results_queue returns)")
def set_write_results_queue(results_queue) -> None:
    """Make megatron's torch_dist writers report into ``results_queue``.

    ``filesystem_async.get_write_results_queue`` (megatron-core 0.19.2) creates a spawned
    ``Manager().Queue()`` per process on the first save unless ``_results_queue`` is set; this
    sets it. ``results_queue`` needs ``put`` (in the writer) and ``get_nowait`` (in the process
    that finalizes the save).
    """
    filesystem_async._results_queue = results_queue
