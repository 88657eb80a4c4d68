"""Timing one collective operation on every rank of a benchmark's worker group: barrier to
barrier, with this rank's CPU time, resident-set peak (``benchmarks.memory.PeakRSS``) and I/O
bytes (``/proc/self/io``); and the interleaving of compared cases over repeats."""

from __future__ import annotations

import gc
import resource
import time

from benchmarks.memory import PeakRSS


def barrier() -> None:
    """Every rank of the benchmark's world waits here (torch.distributed.barrier)."""
    import torch

    torch.distributed.barrier()


def _io_counters() -> dict:
    """This process's I/O counters (``/proc/self/io``): ``rchar``/``wchar`` count bytes passed to
    read/write calls (page-cache hits included), ``read_bytes``/``write_bytes`` bytes that went to
    storage. Empty where there is no /proc."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's children that have ended and been waited
    for (an async save's forked writer counts once the wait for it reaped it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(fn) -> dict:
    """Run the collective ``fn`` between barriers; this rank's seconds (barrier to barrier, and
    ``call_s``: until ``fn`` returned on this rank; ``cpu_s``: this process's CPU time in it;
    ``children_cpu_s``: that of its children reaped in it), RSS and I/O bytes."""
    gc.collect()
    barrier()
    io0 = _io_counters()
    sampler = PeakRSS().start()
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children_cpu()
    fn()
    call, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    children = _children_cpu() - children0
    barrier()
    seconds = time.perf_counter() - t0
    sampler.stop()
    io1 = _io_counters()
    # t_start / t_end: this rank's perf_counter (CLOCK_MONOTONIC, one clock for every process of
    # the machine) when fn started and returned, for spans from the last rank's start.
    out = {"s": seconds, "call_s": call, "cpu_s": cpu, "children_cpu_s": children,
           "rss_base": sampler.base,
           "rss_peak": sampler.peak, "t_start": t0, "t_end": t0 + call}
    for key in ("rchar", "wchar", "read_bytes", "write_bytes"):
        if key in io0 and key in io1:
            out[key] = io1[key] - io0[key]
    return out


def in_turn(items, rep: int) -> list:
    """``items`` in the order of repeat ``rep``: as given on even repeats, reversed on odd ones
    (A B, B A, A B, ...), so that neither one always runs right after the other's kind of
    operation (the first load of a pair runs slower than the second, whichever file it read:
    benchmarks/README.md)."""
    items = list(items)
    return items if rep % 2 == 0 else items[::-1]

