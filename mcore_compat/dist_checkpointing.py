"""The writes into megatron-core's dist-checkpointing private state: the writers' results
queue of its torch_dist save (``strategies.filesystem_async._results_queue``), and its writer
keeping the cause of a failed write."""

from __future__ import annotations

import errno
import functools
import resource

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


@megatron_patch("dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync."
                "write_preloaded_data (its main worker's error raised, not returned)")
def keep_write_errors() -> None:
    """Keep the cause of a failed write in megatron's error.

    megatron-core 0.19.2's torch_dist writer (``FileSystemWriterAsync.write_preloaded_data``)
    returns the exception of a failed write (``OSError: [Errno 28] No space left on device``)
    to its caller, which asserts the result is a list and reports only
    ``error: <class 'OSError'>``. Raised instead, the caller's ``except`` puts the exception's
    own text into the error every rank raises; under a file-size limit (``ulimit -f``: torch's
    stream writer then reports only ``unexpected pos``), with that limit. Writers on threads of their own (which report
    through a queue, ``thread_count > 1``) are left as they are. Idempotent.
    """
    cls = filesystem_async.FileSystemWriterAsync
    original = cls.write_preloaded_data
    if getattr(original, "keeps_write_errors", False):
        return

    @functools.wraps(original)  # megatron inspects its signature
    def write_preloaded_data(*args, **kwargs):
        output = original(*args, **kwargs)
        if kwargs.get("results_queue") is None and isinstance(output, tuple) \
                and isinstance(output[1], BaseException):
            error = output[1]
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:  # torch's own writer hides the EFBIG
                raise OSError(errno.EFBIG, f"{error} (this process may write no file larger "
                                           f"than {limit} bytes: RLIMIT_FSIZE, ulimit -f)")
            raise error
        return output

    write_preloaded_data.keeps_write_errors = True
    cls.write_preloaded_data = staticmethod(write_preloaded_data)
