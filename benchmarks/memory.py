"""Resident memory of this process: the current RSS and its peak over a stretch of code.

``PeakRSS`` samples ``/proc/self/statm`` (psutil where there is no /proc) from a daemon thread
every ``interval`` seconds (default 1 ms) between ``start()`` and ``stop()``, plus once at each
end. What it misses: an allocation that is made and freed again within one sampling interval
(a tensor copy of a few MB lives longer than that on these CPUs). ``ru_maxrss`` (the process's
lifetime high-water mark) is reported separately by :func:`max_rss`.

Freed memory only shows up as a lower RSS when the allocator returns it to the kernel: the
benchmark workers run with ``MALLOC_MMAP_THRESHOLD_`` set (see :data:`MALLOC_ENV`), which puts
every allocation above 64 KiB in its own mmap (returned on free), so that one measurement's
buffers do not hide in the heap of the next.
"""

from __future__ import annotations

import os
import resource
import threading

# glibc: fixed mmap threshold (this also switches off its dynamic growth), trim the heap top.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int:
    """Resident bytes of this process now."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def max_rss() -> int:
    """Lifetime peak resident bytes of this process (``getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.base`` (RSS at start) and ``m.peak`` (max seen)."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            value = rss()
            if value > self.peak:
                self.peak = value

    def start(self) -> "PeakRSS":
        self.base = self.peak = rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "PeakRSS":
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss())
        return self

    @property
    def delta(self) -> int:
        return self.peak - self.base

    def __enter__(self) -> "PeakRSS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
