"""Checkpoint save and load: the logical GTP layout (gtp/ on) against megatron-core 0.19.2's.

    python -m benchmarks.checkpoint_io                 # gpt125m, 5 interleaved repeats
    python -m benchmarks.checkpoint_io --quick         # tiny model, 2 repeats
    python -m benchmarks.checkpoint_io --repeats 9 --no-padded --out outputs/bench
    python -m benchmarks checkpoint                    # the same, through the suite

Launches of worker processes (torch's elastic launcher, as ``train.py``); each builds its model,
DDP, Adam and scheduler with ``recipes.worker.setup`` and runs one training step, so every
checkpoint holds the Adam moments:

1. **Save** at the source layout ``tp2 x g2/a16`` (world 4), in one process group, ``--repeats``
   times: save in the logical layout (``gtp.checkpoint.configure("logical")``) and in the stock
   layout (``"stock"``: megatron 0.19.2 as shipped), in turn (A B, B A, ...), raw write with every
   rank writing the bytes it wrote in the save to one file, raw write with rank 0 writing all
   the bytes to one file (plain ``open``/``write`` of 8 MiB blocks, then ``os.fsync`` as
   megatron's writer ends each file). One untimed save of each layout comes first. Then
   same-layout loads, in turn: the logical file, the stock file. gpt125m's TP-local GTP
   dims (1152, 768, 1536, 160) are multiples of 32, so a16 pads nothing; a second save launch at
   ``tp2 x g2/a40`` (``--padded``, default on, off with ``--quick``) pads every GTP weight, where
   the logical layout writes trimmed views of the padded shards.
2. **Cross-layout load** of the source's logical file to ``tp1, gtp off`` (world 1) and to
   ``tp1 x g4/a32`` (world 4): each launch first saves a checkpoint at its own layout, then
   alternates loading the source (cross-layout) with loading its own file (same-layout at that
   layout: the baseline with the same world size and bytes per rank). With ``--control``
   (default) the tp1 launch also loads a checkpoint saved at ``tp2, gtp off`` (world 2):
   megatron's own cross-TP resharding, no GTP anywhere. Every target also loads the source's
   logical file with torch's own ``FileSystemReader.read_data`` (``gtp.dcp_reader.disabled``),
   which reads each stored chunk whole, beside ``gtp.dcp_reader``, which reads the requested
   rows only. The stock source file is not loaded
   cross-layout: stock megatron-core 0.19.2 cannot (its padded GTP layout is the bug ``gtp/``
   fixes; ``gtp/legacy`` converts such a file once instead).
3. **Write throughput**: checkpoint bytes / save seconds next to the raw writes of step 1 (same
   directory, same bytes, same run).
4. **Asynchronous save** (``checkpoint.async_save``): in each repeat of step 1, after the
   synchronous saves, a logical save through ``recipes.checkpoint.AsyncSaves``. What it costs
   training, the figure the target is judged on: ``TRAIN_STEPS`` training steps right after
   the save (an async save's write goes on during them; the time includes waiting for it to be
   finalized) minus the same steps without a save, over the same figure of a synchronous
   save; the three (steps alone, async save then steps, sync save then steps) are measured in
   turn in each repeat, each as one measurement with its parts marked inside, and timed from
   the last rank's start to the last rank's end. The forked writer shares the training
   process's memory copy-on-write: every page training writes while the writer runs is copied
   first, and the writer takes CPU time from the ranks; both land in those steps. Also shown:
   the stall, barrier to barrier around ``save_checkpoint`` (the time until the call returned
   on the slowest rank beside it); the run's first async save, which plans and validates while
   later ones reuse its plan; and the write and finalize of an async save with no training
   (``--targets`` with no name skips step 2).

Every figure is one collective operation timed barrier-to-barrier on every rank
(``save_checkpoint`` / ``load_checkpoint`` of ``recipes.checkpoint`` as the training loop calls
them: tracker file, disk-space and shape checks included); a repeat counts its slowest rank, the
tables show medians over repeats (and the minimum), ratios of medians and, in parentheses, the
median of the per-repeat ratios (each pair measured back to back). Memory: each rank's resident
set (RSS) sampled every 1 ms by a thread during the operation (``benchmarks.memory``), reported
as its peak and as its increase over the RSS right before the operation; workers run with
glibc's mmap threshold fixed so that freed buffers leave the RSS. Bytes read per rank are the
``rchar`` counter of ``/proc/self/io`` (page-cache hits included: loads read files that were just
written). Checkpoints and raw files go to ``<out>/files`` (removed at the end unless ``--keep``).
Figures depend on the machine and on whatever else runs on it (the load average is recorded);
targets are printed, never enforced. Output: tables on stdout, ``<out>/table.txt`` and
``<out>/results.json`` (every measurement of every rank).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.memory import MALLOC_ENV, PeakRSS, max_rss
from benchmarks.tables import table

REPO = Path(__file__).resolve().parents[1]

# model -> config overrides ({dp} is filled in): one micro-batch per rank, seq 64.
MODELS: dict[str, list[str]] = {
    "gpt125m": ["model=gpt125m", "model.seq_length=64", "data=mock", "data.micro_batch_size=1",
                "data.global_batch_size={dp}"],
    "tiny": ["model=tiny", "data=mock", "data.micro_batch_size=1", "data.global_batch_size={dp}"],
}
# name -> (tp, gtp degree, pad_for_alignment, world size)
SOURCE = ("tp2_g2a16", (2, 2, 16, 4))
# The same save at an alignment that pads every GTP weight of gpt125m (its TP-local dims 1152,
# 768, 1536 and 160 are multiples of 32, so a16 adds no padding row): the logical layout then
# writes trimmed views of the padded shards.
PADDED_SOURCE = ("tp2_g2a40", (2, 2, 40, 4))
# Control for the load to tp1 without GTP: a checkpoint saved at tp2 without GTP (world 2), whose
# load at tp1 is megatron's own cross-TP resharding, no gtp/ code on either side.
CONTROL = ("tp2_off", (2, 1, None, 2))
TARGETS: dict[str, tuple[int, int, int | None, int]] = {
    "tp1_off": (1, 1, None, 1),
    "tp1_g4a32": (1, 4, 32, 4),
}
RAW_BLOCK = 8 << 20

TARGET_SAVE_RATIO = 1.02
TARGET_PEAK_RATIO = 1.02
TARGET_SAME_LOAD_RATIO = 1.02
# extra RSS of a same-layout load of the logical file over the stock file's, as a fraction of the
# checkpoint's bytes per rank
TARGET_SAME_LOAD_EXTRA_MEMORY = 0.02
# cross-layout / same-layout load: at most this, or no worse than megatron's own cross-TP control
TARGET_LOAD_RATIO = 1.15
TARGET_THROUGHPUT_FRACTION = 0.5
# training time lost to an asynchronous save (checkpoint.async_save) / the synchronous save's time
TARGET_ASYNC_LOST_RATIO = 0.2
# Training steps run after each save of [4]'s cost measurement: enough to outlast an async
# save's write (the figures: benchmarks/README.md).
TRAIN_STEPS = 2


def describe(tp: int, g: int, pad) -> str:
    return f"tp{tp}" + (f" x g{g}/a{pad}" if g > 1 else ", gtp off")


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------
def _barrier() -> None:
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


def _measure(fn) -> dict:
    """Run the collective ``fn`` between barriers; this rank's seconds (barrier to barrier, and
    ``call_s``: until ``fn`` returned on this rank; ``cpu_s``: this process's CPU time in it;
    ``children_cpu_s``: that of its children reaped in it), RSS and I/O bytes."""
    gc.collect()
    _barrier()
    io0 = _io_counters()
    sampler = PeakRSS().start()
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children_cpu()
    fn()
    call, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    children = _children_cpu() - children0
    _barrier()
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


def _in_turn(items, rep: int) -> list:
    """``items`` in the order of repeat ``rep``: as given on even repeats, reversed on odd ones
    (A B, B A, A B, ...), so that neither one always runs right after the other's kind of
    operation (the first load of a pair runs slower than the second, whichever file it read:
    benchmarks/README.md)."""
    items = list(items)
    return items if rep % 2 == 0 else items[::-1]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _rank_bytes(iter_path: Path, rank: int) -> int:
    """Bytes of the tensor files this rank wrote (megatron names them ``__<rank>_<n>.distcp``)."""
    return sum(f.stat().st_size for f in Path(iter_path).glob(f"__{rank}_*.distcp"))


def _raw_write(path: Path, nbytes: int, block: bytes) -> None:
    """Plain sequential write of ``nbytes`` to ``path``, then fsync (as megatron's writer)."""
    view = memoryview(block)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _gtp_layout(iter_path: Path) -> dict:
    from megatron.core import dist_checkpointing

    from gtp.checkpoint import METADATA_KEY

    return dist_checkpointing.load_common_state_dict(str(iter_path)).get(METADATA_KEY) or {}


def _gtp_format(iter_path: Path) -> str | None:
    return _gtp_layout(iter_path).get("gtp_format")


def _param_count(iter_path: Path) -> dict:
    """Logical element counts from a checkpoint's metadata: model tensors and all tensors."""
    from math import prod

    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(iter_path))
    model = sum(prod(t.global_shape) for k, t in meta.items() if not k.startswith("optimizer."))
    total = sum(prod(t.global_shape) for t in meta.values())
    return {"model_parameters": int(model), "checkpoint_elements": int(total)}


def _worker(cfg_path: str, out_path: str) -> None:
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from gtp import checkpoint as gtp_checkpoint, dcp_reader
    from recipes import checkpoint
    from recipes.data import build_train_iterator
    from recipes.loop import train_step
    from recipes.validate import validate
    from recipes.worker import init_distributed, setup

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    cfg = OmegaConf.load(cfg_path)
    bench = cfg.bench
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    layout = validate(cfg, world)
    t_setup = time.perf_counter()
    tokenizer, model, optimizer, scheduler = setup(cfg, layout)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank, dp_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    data = build_train_iterator(cfg, 0, dp_rank, dp_size, tokenizer=tokenizer)
    num_micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp_size)
    train_step(model, optimizer, scheduler, data, num_micro, cfg)  # Adam moments exist from here
    setup_s = time.perf_counter() - t_setup
    record = checkpoint.layout_record(layout)
    common = {"consumed_samples": cfg.data.global_batch_size, "wandb_run_id": None}
    root = Path(bench.files)
    mine: dict = {"rank": rank, "setup_and_step_s": setup_s,
                  "cores": len(os.sched_getaffinity(0)),
                  "local_param_numel": sum(p.numel() for p in model.parameters())}
    shared: dict = {"layout": layout.describe()}

    def save(kind: str, where: Path, iteration: int) -> None:
        gtp_checkpoint.configure(kind)
        checkpoint.save_checkpoint(where, iteration, model, optimizer, scheduler, common, record)

    async_saves = checkpoint.AsyncSaves()

    def save_async(where: Path, iteration: int) -> None:
        """What training waits for in an asynchronous save (the write goes on after)."""
        gtp_checkpoint.configure("logical")
        checkpoint.save_checkpoint(where, iteration, model, optimizer, scheduler, common, record,
                                   async_saves=async_saves)

    def load(kind: str, where: Path) -> None:
        gtp_checkpoint.configure(kind)
        # Not verified first: these rows compare readers and layouts (bytes read included);
        # benchmarks.checkpoint_verify measures what the verification adds.
        checkpoint.load_checkpoint(where, model, optimizer, scheduler, record, verify=False)

    def drop(path: Path) -> None:
        _barrier()
        if rank == 0 and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        _barrier()

    repeats = int(bench.repeats)
    if bench.phase == "save":
        root = root / bench.tag
        kinds = ("logical", "stock")
        for kind in kinds:  # untimed warm-up of each code path
            save(kind, root / f"warmup_{kind}", 1)
            if kind == "logical":
                my_bytes = _rank_bytes(checkpoint.iter_dir(root / "warmup_logical", 1), rank)
                every = [None] * world
                torch.distributed.all_gather_object(every, my_bytes)
                total_bytes = _dir_bytes(checkpoint.iter_dir(root / "warmup_logical", 1))
            drop(root / f"warmup_{kind}")
        # The first async save of a run plans and validates (later ones reuse its plan): timed
        # apart, not among the repeats.
        first_async = _measure(lambda: save_async(root / "warmup_async", 1))
        async_saves.wait()
        drop(root / "warmup_async")
        block = os.urandom(RAW_BLOCK)
        raw_dir = root / "raw"
        if rank == 0:
            raw_dir.mkdir(parents=True, exist_ok=True)
        _barrier()
        saves = {k: [] for k in kinds}
        saves["async_stall"], saves["async_rest"] = [], []
        saves["async_first_stall"] = [first_async]
        saves.update(train_plain=[], train_async=[], train_sync=[])
        train_steps = int(bench.get("train_steps", TRAIN_STEPS))
        mine["train_steps"] = train_steps

        def train() -> None:
            for _ in range(train_steps):
                train_step(model, optimizer, scheduler, data, num_micro, cfg)
        raw = {"parallel": [], "single": []}
        for rep in range(repeats):
            it = rep + 1
            for kind in _in_turn(kinds, rep):
                m = _measure(lambda: save(kind, root / f"save_{kind}", it))
                if rank == 0:
                    m["bytes"] = _dir_bytes(checkpoint.iter_dir(root / f"save_{kind}", it))
                saves[kind].append(m)
                if rep:
                    drop(checkpoint.iter_dir(root / f"save_{kind}", it - 1))
            saves["async_stall"].append(_measure(lambda: save_async(root / "save_async", it)))
            saves["async_rest"].append(_measure(async_saves.wait))  # writing, then finalize
            if rep:
                drop(checkpoint.iter_dir(root / "save_async", it - 1))
            # What a save costs training: the same steps with no save before them, after a
            # synchronous save, and with an asynchronous save's write going on (then the wait
            # for it), the three in turn; each one measurement, its parts marked inside (a
            # barrier or collection between them would hide time the writer takes).
            for key in _in_turn(("plain", "async", "sync"), rep):
                where = root / f"train_{key}"
                parts = {"plain": [("steps", train)],
                         "async": [("save", lambda: save_async(where, it)), ("steps", train),
                                   ("wait", async_saves.wait)],
                         "sync": [("save", lambda: save("logical", where, it)),
                                  ("steps", train)]}[key]
                marks: dict = {}

                def run_parts() -> None:
                    for part, fn in parts:
                        t0 = time.perf_counter()
                        fn()
                        marks[part] = (t0, time.perf_counter())

                saves[f"train_{key}"].append({**_measure(run_parts), "parts": marks})
                if key != "plain":
                    drop(where)
            m = _measure(lambda: _raw_write(raw_dir / f"parallel_{rank}.bin", my_bytes, block))
            raw["parallel"].append({**m, "bytes": my_bytes})
            drop(raw_dir)
            if rank == 0:
                raw_dir.mkdir(parents=True, exist_ok=True)
            m = _measure(lambda: _raw_write(raw_dir / "single.bin", total_bytes, block)
                         if rank == 0 else None)
            raw["single"].append({**m, "bytes": total_bytes if rank == 0 else 0})
            drop(raw_dir)
            if rank == 0:
                raw_dir.mkdir(parents=True, exist_ok=True)
        drop(raw_dir)
        loads = {k: [] for k in kinds}
        for kind in kinds:  # warm-up
            load(kind, root / f"save_{kind}")
        for rep in range(repeats):
            for kind in _in_turn(kinds, rep):
                loads[kind].append(_measure(lambda: load(kind, root / f"save_{kind}")))
        gtp_checkpoint.configure("logical")
        mine.update(saves=saves, raw=raw, loads=loads)
        if rank == 0:
            last = {k: checkpoint.iter_dir(root / f"save_{k}", repeats) for k in kinds}
            shared.update(
                rank_bytes=every, checkpoint_bytes=total_bytes,
                bytes_by_layout={k: _dir_bytes(p) for k, p in last.items()},
                gtp_format={k: _gtp_format(p) for k, p in last.items()},
                # padding rows per TP-local GTP weight (gtp/checkpoint.py's metadata)
                gtp_padding_rows={key: rec["pad"] for key, rec in
                                  _gtp_layout(last["logical"]).get("tensors", {}).items()},
                **_param_count(last["logical"]),
                source=str(root / "save_logical"),
            )
    elif bench.phase == "save_only":  # a checkpoint for another launch to load
        save("logical", root / bench.tag, 1)
        shared.update(source=str(root / bench.tag))
    else:  # cross-layout load at this launch's layout
        native = root / f"native_{bench.target}"
        save("logical", native, 1)
        # "cross": the source's logical file; controls: other files (loaded with gtp/'s
        # patch installed, or with stock megatron when the key starts with "stock").
        # "torch_reader": the cross file again, read by torch's own read_data (whole chunks).
        paths = {"cross": Path(bench.source), "torch_reader": Path(bench.source),
                 **{k: Path(v) for k, v in (bench.get("controls") or {}).items()},
                 "native": native}

        def kind_of(key: str) -> str:
            return "stock" if key.startswith("stock") else "logical"

        def load_as(key: str, path: Path) -> None:
            with dcp_reader.disabled() if key == "torch_reader" else contextlib.nullcontext():
                load(kind_of(key), path)

        for key, path in paths.items():  # warm-up
            load_as(key, path)
        loads = {k: [] for k in paths}
        for rep in range(repeats):
            for key, path in _in_turn(paths.items(), rep):
                loads[key].append(_measure(lambda: load_as(key, path)))
        gtp_checkpoint.configure("logical")
        mine.update(loads=loads)
        if rank == 0:
            shared.update(native_bytes=_dir_bytes(checkpoint.iter_dir(native, 1)),
                          native_gtp_format=_gtp_format(checkpoint.iter_dir(native, 1)))
    mine["max_rss"] = max_rss()
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps({**shared, "ranks": every}))
    _barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------
def compose_config(model: str, tp: int, g: int, pad, world: int, run_dir: Path, cache: Path,
                   bench: dict):
    """The resolved run config of one launch (Hydra compose, as train.py builds it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config import register_configs

    register_configs()
    dp = world // tp  # the data-loading group is dp x gtp: every GTP peer reads its own batch
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            *(o.format(dp=dp) for o in MODELS[model]),
            "gtp=off" if g == 1 else "gtp=tp2_align16",
            f"gtp.gtp_remat_size={g}", f"gtp.pad_for_alignment={'null' if pad is None else pad}",
            "checkpoint.format=logical",
            "parallelism=tp1", f"parallelism.tensor_model_parallel_size={tp}",
            f"parallelism.nproc_per_node={world}",
            "checkpoint=none", "logger=none", f"output_dir={run_dir}",
            f"data.cache_dir={cache}", "train.train_iters=10", "optim.lr_warmup_iters=0",
        ])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["bench"] = bench
    return OmegaConf.create(plain)


def _per_rep(ranks: list[dict], *path: str) -> list[list[dict]]:
    """``[rep][rank] -> measurement`` for ``rank[path...]``."""
    series = []
    for r in ranks:
        node = r
        for key in path:
            node = node[key]
        series.append(node)
    return [list(x) for x in zip(*series)]


def _stats(ranks: list[dict], *path: str) -> dict:
    """Median over repeats of the slowest rank's seconds (barrier to barrier; ``call_*``: until
    the call returned); per rank: median peak RSS, RSS increase and bytes read/written
    (``/proc/self/io``)."""
    reps = _per_rep(ranks, *path)
    walls = [max(m["s"] for m in rep) for rep in reps]
    n_ranks = len(reps[0])

    def med(fn):
        return [statistics.median(fn(rep[i]) for rep in reps) for i in range(n_ranks)]

    calls = [max(m.get("call_s", m["s"]) for m in rep) for rep in reps]
    out = {"median_s": statistics.median(walls), "min_s": min(walls), "runs_s": walls,
           "call_median_s": statistics.median(calls), "call_min_s": min(calls), "call_runs_s": calls,
           "peak_rss_per_rank": med(lambda m: m["rss_peak"]),
           "rss_increase_per_rank": med(lambda m: m["rss_peak"] - m["rss_base"])}
    for key in ("rchar", "wchar", "read_bytes", "write_bytes"):
        if all(key in m for rep in reps for m in rep):
            out[f"{key}_per_rank"] = med(lambda m: m[key])
    return out


def _paired(a: dict, b: dict) -> float:
    """Median over repeats of a[rep] / b[rep] (measured next to each other)."""
    return statistics.median(x / y for x, y in zip(a["runs_s"], b["runs_s"]))


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}" if abs(x) >= 10 * 2**20 else f"{x / 2**20:.1f}"


def _per_rank(values) -> str:
    return " / ".join(_mib(v) for v in values) if values else "-"


def _verdict(value: float, limit: float, at_most: bool = True) -> str:
    ok = value <= limit if at_most else value >= limit
    return ("<= " if at_most else ">= ") + f"{limit:g}: " + ("met" if ok else "MISSED")


def _span(marks: list[tuple[float, float]]) -> float:
    """A collective's span over its ranks' ``(start, end)`` clock marks: from the last rank's
    start (on a loaded machine the ranks leave a barrier at different times; a rank that left
    early only waits inside) to the last rank's end."""
    return max(e for _, e in marks) - max(t for t, _ in marks)


def _training_cost(ranks: list[dict]) -> dict:
    """What a save costs training, per repeat, then medians over repeats.

    ``lost_s``: the span of the save and the steps after it (async: and the wait for its write)
    minus the span of the same steps with no save, measured next to each other;
    ``steps_slower_s``: the steps' own part of it; ``ratio_over_sync_lost``: the async save's
    ``lost_s`` over the sync save's (both hold the steps' noise; None where the sync figure is
    not positive); ``ratio_over_sync_save``: over the sync save's own span.

    ``writer_cpu_s``: per rank, the median CPU seconds of the async save's forked writer (its
    rank's children reaped by the wait); ``sync_save_cpu_s``: per rank, those of a sync save
    (the rank's own and its children's); ``writers_cpu_over_cores_s``: the writers' median CPU
    summed over ranks and divided by the cores the ranks run on: the training time the writers
    take when training keeps every core busy.
    """
    reps = {k: _per_rep(ranks, "saves", f"train_{k}") for k in ("plain", "async", "sync")}

    def whole(rep):
        return _span([(m["t_start"], m["t_end"]) for m in rep])

    def part(rep, name):
        return _span([tuple(m["parts"][name]) for m in rep])

    out: dict = {"train_steps": ranks[0].get("train_steps"), "lost_s": {}, "steps_slower_s": {}}
    for k in ("async", "sync"):
        pairs = list(zip(reps[k], reps["plain"]))
        out["lost_s"][k] = statistics.median(whole(a) - whole(p) for a, p in pairs)
        out["steps_slower_s"][k] = statistics.median(
            part(a, "steps") - part(p, "steps") for a, p in pairs)
    out["sync_save_s"] = statistics.median(part(r, "save") for r in reps["sync"])
    n_ranks = len(ranks)
    out["writer_cpu_s"] = [statistics.median(rep[i]["children_cpu_s"] for rep in reps["async"])
                           for i in range(n_ranks)]
    sync_saves = _per_rep(ranks, "saves", "logical")
    out["sync_save_cpu_s"] = [
        statistics.median(rep[i]["cpu_s"] + rep[i]["children_cpu_s"] for rep in sync_saves)
        for i in range(n_ranks)]
    out["cores"] = ranks[0]["cores"]
    out["writers_cpu_over_cores_s"] = sum(out["writer_cpu_s"]) / out["cores"]
    lost = out["lost_s"]
    out["ratio_over_sync_lost"] = lost["async"] / lost["sync"] if lost["sync"] > 0 else None
    out["ratio_over_sync_save"] = lost["async"] / out["sync_save_s"]
    return out


def summarize_save(res: dict) -> dict:
    """Save, same-layout load and write-throughput figures of one save launch."""
    ranks = res["ranks"]
    s = {k: _stats(ranks, "saves", k) for k in ("logical", "stock")}
    asyncs = {k: _stats(ranks, "saves", k) for k in ("async_stall", "async_rest",
                                                     "async_first_stall", "train_plain",
                                                     "train_async", "train_sync")}
    training = _training_cost(ranks)
    raw = {k: _stats(ranks, "raw", k) for k in ("parallel", "single")}
    nbytes = res["checkpoint_bytes"]
    t = {
        "checkpoint_bytes": nbytes,
        "save_logical_Bps": nbytes / s["logical"]["median_s"],
        "stock_checkpoint_bytes": res["bytes_by_layout"]["stock"],
        "save_stock_Bps": res["bytes_by_layout"]["stock"] / s["stock"]["median_s"],
        "raw_parallel_Bps": nbytes / raw["parallel"]["median_s"],
        "raw_single_Bps": nbytes / raw["single"]["median_s"],
        "raw": raw,
    }
    t["raw_best_Bps"] = max(t["raw_parallel_Bps"], t["raw_single_Bps"])
    t["fraction_logical_of_raw_best"] = t["save_logical_Bps"] / t["raw_best_Bps"]
    return {
        "layout": res["layout"], "label": res["label"], "gtp_format": res["gtp_format"],
        "save": {**s,
                 "time_ratio_logical_over_stock": s["logical"]["median_s"] / s["stock"]["median_s"],
                 "paired_time_ratio_logical_over_stock": _paired(s["logical"], s["stock"]),
                 "peak_rss_ratio_logical_over_stock_per_rank": [
                     a / b for a, b in zip(s["logical"]["peak_rss_per_rank"],
                                           s["stock"]["peak_rss_per_rank"])],
                 "rss_increase_diff_logical_minus_stock_per_rank": [
                     a - b for a, b in zip(s["logical"]["rss_increase_per_rank"],
                                           s["stock"]["rss_increase_per_rank"])]},
        "same_layout_load": {k: _stats(ranks, "loads", k) for k in ("logical", "stock")},
        "rank_bytes": res["rank_bytes"],
        # The stall: barrier to barrier, as every figure here: a collective right after the save
        # (training's next) also waits for ranks that share their cores with the writers. Until
        # save_checkpoint returned on the slowest rank: beside it, for information.
        "async_save": {**asyncs,
                       "stall_ratio_over_sync_logical":
                           asyncs["async_stall"]["median_s"] / s["logical"]["median_s"],
                       "paired_stall_ratio": _paired(asyncs["async_stall"], s["logical"]),
                       "call_ratio_over_sync_logical":
                           asyncs["async_stall"]["call_median_s"] / s["logical"]["median_s"],
                       **training},
        "throughput": t,
    }


def summarize_cross(res: dict, name: str, source_same_layout_s: float) -> dict:
    if "error" in res:
        return {"error": res["error"]}
    loads = {k: _stats(res["ranks"], "loads", k) for k in res["ranks"][0]["loads"]}
    n = loads["native"]
    return {
        "layout": res["layout"], "world": len(res["ranks"]),
        "label": f"{describe(*TARGETS[name][:3])} (world {len(res['ranks'])})",
        **loads,
        "controls": [k for k in loads if k not in ("cross", "native")],
        "ratio_over_native": {k: v["median_s"] / n["median_s"] for k, v in loads.items()},
        "paired_ratio_over_native": {k: _paired(v, n) for k, v in loads.items()},
        "ratio_cross_over_native": loads["cross"]["median_s"] / n["median_s"],
        "ratio_cross_over_source_same_layout": loads["cross"]["median_s"] / source_same_layout_s,
        "native_bytes": res.get("native_bytes"),
    }


CONTROL_LABEL = "tp2, gtp off (world 2)"


def format_tables(summary: dict, head: dict) -> str:
    saves = summary["saves"]
    main = saves[head["source_name"]]
    reps = head["repeats"]
    parts = [f"[1] save (world 4), {reps} interleaved repeats (logical and stock in turn, raw, raw, ...); "
             f"checkpoint {_mib(main['throughput']['checkpoint_bytes'])} MiB. s: median (min); "
             f"vs stock: ratio of medians (median of per-repeat ratios)"]
    rows, notes = [], []
    for name, x in saves.items():
        s = x["save"]
        for kind, label in (("logical", "logical (gtp/ on)"), ("stock", "stock 0.19.2 (gtp/ off)")):
            m = s[kind]
            ratio = m["median_s"] / s["stock"]["median_s"]
            rows.append([x["label"], label, f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         f"{ratio:.2f} ({_paired(m, s['stock']):.2f})",
                         _verdict(ratio, TARGET_SAVE_RATIO) if kind == "logical" else "",
                         _per_rank(m["peak_rss_per_rank"]), _per_rank(m["rss_increase_per_rank"])])
        worst = max(s["peak_rss_ratio_logical_over_stock_per_rank"])
        notes.append(f"{x['label']}: peak RSS logical / stock, worst rank {worst:.3f} (target "
                     f"{_verdict(worst, TARGET_PEAK_RATIO)}); RSS increase logical - stock per "
                     f"rank {_per_rank(s['rss_increase_diff_logical_minus_stock_per_rank'])} MiB")
    parts.append(table(["saved at", "layout written", "s", "vs stock", "target",
                         "peak RSS MiB per rank", "RSS increase MiB per rank"], rows))
    parts += notes

    parts.append("")
    parts.append(f"[2] load, {reps} interleaved repeats: each cross-layout load alternates (A B, B A, "
                 f"...) with a same-layout load at its target layout (a file saved there) in one launch. "
                 f"s: median (min); vs same-layout: ratio of medians (median of per-repeat ratios)")
    rows = []
    for name, x in saves.items():
        sl = x["same_layout_load"]
        for kind, label in (("logical", "same-layout, logical file"),
                            ("stock", "same-layout, stock file")):
            m = sl[kind]
            ratio = m['median_s'] / sl['stock']['median_s']
            vs = f"{ratio:.2f} ({_paired(m, sl['stock']):.2f}) of stock"
            rows.append([f"{x['label']} (world 4)", label,
                         f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         vs, _verdict(ratio, TARGET_SAME_LOAD_RATIO) if kind == "logical" else "",
                         _per_rank(m["peak_rss_per_rank"]),
                         _per_rank(m["rss_increase_per_rank"]), _per_rank(m.get("rchar_per_rank"))])
    for name, c in summary["cross_layout_load"].items():
        if "error" in c:
            rows.append([f"-> {name}", "error: " + c["error"], "", "", "", "", "", ""])
            continue
        control_labels = {
            "control": f"control: from {CONTROL_LABEL}",
            "stock_file": f"control: from {main['label']}, stock file, stock megatron",
            "torch_reader": f"control: from {main['label']}, logical file, torch's reader",
        }
        kinds = [("native", "same-layout (saved there)"),
                 ("cross", f"from {main['label']}, logical file"),
                 *[(k, control_labels.get(k, k)) for k in c["controls"]]]
        for which, label in kinds:
            m = c[which]
            ratio = c["ratio_over_native"][which]
            control = max((c["ratio_over_native"][k] for k in c["controls"] if k == "control"),
                          default=None)
            verdict = ""
            if which == "cross":
                verdict = _verdict(ratio, TARGET_LOAD_RATIO)
                if control is not None:
                    verdict += f"; control {control:.2f}: " + (
                        "no worse" if ratio <= control else "WORSE")
            rows.append([f"-> {c['label']}", label, f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         f"{ratio:.2f} ({c['paired_ratio_over_native'][which]:.2f})", verdict,
                         _per_rank(m["peak_rss_per_rank"]), _per_rank(m["rss_increase_per_rank"]),
                         _per_rank(m.get("rchar_per_rank"))])
        if "stock_file" not in c["controls"]:
            rows.append([f"-> {c['label']}", f"from {main['label']}, stock file", "n/a",
                         "", "", "", "", ""])
    for name, x in saves.items():
        sl = x["same_layout_load"]
        extra = [a - b for a, b in zip(sl["logical"]["rss_increase_per_rank"],
                                       sl["stock"]["rss_increase_per_rank"])]
        frac = max(e / max(b, 1) for e, b in zip(extra, x["rank_bytes"]))
        rows.append([f"{x['label']} (world 4)", "same-layout: logical RSS increase - stock's, "
                     "of the rank's checkpoint bytes", f"{frac:.3f}", "",
                     _verdict(frac, TARGET_SAME_LOAD_EXTRA_MEMORY), "", _per_rank(extra), ""])
    parts.append(table(["load to", "file", "s", "vs same-layout", "target",
                         "peak RSS MiB per rank", "RSS increase MiB per rank",
                         "MiB read per rank"], rows))
    parts.append("n/a: stock megatron-core 0.19.2 cannot load its GTP file at another GTP layout "
                 "(the bug gtp/ fixes), so those cross-layout loads are of the logical file only.")
    used = {k for c in summary["cross_layout_load"].values() for k in c.get("controls", [])}
    if "control" in used:
        parts.append(f"control from {CONTROL_LABEL}: megatron's own cross-TP resharding, no GTP "
                     f"on either side.")
    if "stock_file" in used:
        parts.append(f"control from the stock file: {main['label']} pads no row of this model, "
                     f"so its stock file holds the logical rows and stock megatron (gtp/ off) "
                     f"reads it into a non-GTP model (with padding rows it cannot).")
    cross = {n: c for n, c in summary["cross_layout_load"].items() if "error" not in c}
    if cross:
        parts.append(f"cross-layout load / same-layout load at {main['label']}: " + ", ".join(
            f"{c['label']} {c['ratio_cross_over_source_same_layout']:.2f}x" for c in cross.values())
            + " (other world size or bytes per rank; for information)")

    parts.append("")
    steps = next(iter(saves.values()))["async_save"]["train_steps"]
    parts.append(f"[4] asynchronous save (checkpoint.async_save=true), {reps} repeats interleaved "
                 f"with [1]. Training time lost to a save: the save and {steps} training steps "
                 f"right after it (for an async save its write goes on during them; then the "
                 f"wait for its write to be finalized), minus the same steps with no save, per "
                 f"repeat, each timed from the last rank's start to the last rank's end; the "
                 f"target is judged on the async figure over the sync one (both hold the steps' "
                 f"noise; over the sync save's own time: beside it). Steps slower: the steps' "
                 f"own part. Stall: barrier to barrier around save_checkpoint (until it "
                 f"returned on the slowest rank: beside it); the first async save of a run (it "
                 f"plans and validates; later saves reuse its plan) is timed apart; "
                 f"write+finalize: the wait after an async save with no training")
    rows = []
    for name, x in saves.items():
        a = x["async_save"]
        st, lost, slower = a["async_stall"], a["lost_s"], a["steps_slower_s"]
        ratio = a["ratio_over_sync_lost"]
        rows.append([x["label"], f"{a['sync_save_s']:.2f}",
                     f"{lost['sync']:.2f} / {lost['async']:.2f}",
                     "n/a" if ratio is None else f"{ratio:.2f}",
                     "n/a: no sync cost above the noise" if ratio is None
                     else _verdict(ratio, TARGET_ASYNC_LOST_RATIO),
                     f"{a['ratio_over_sync_save']:.2f}",
                     f"{a['train_plain']['median_s']:.2f}",
                     f"{slower['sync']:+.2f} / {slower['async']:+.2f}",
                     f"{st['median_s']:.3f} ({a['stall_ratio_over_sync_logical']:.2f}x)",
                     f"{st['call_median_s']:.3f}",
                     f"{a['async_first_stall']['median_s']:.3f}",
                     f"{a['async_rest']['median_s']:.2f}",
                     f"{statistics.median(a['sync_save_cpu_s']):.2f} / "
                     f"{statistics.median(a['writer_cpu_s']):.2f}",
                     f"{a['writers_cpu_over_cores_s']:.2f}"])
    cores = max(x["async_save"]["cores"] for x in saves.values())
    parts.append(table(["saved at", "sync save s", "training lost s: sync / async",
                        "async / sync lost", "target", "async lost / sync save",
                        f"{steps} steps s, no save", "steps slower s: sync / async",
                        "async stall s (of sync save)", "until returned s",
                        "first async save s", "write+finalize s",
                        "CPU s per rank: sync save / async writer",
                        f"writers' CPU over {cores} cores s"], rows))
    parts.append(f"CPU: user + system seconds, median over repeats, then over ranks; a sync "
                 f"save's are its rank's own and its children's, an async save's writer's are "
                 f"its rank's reaped children's. Over the cores: the writers' CPU summed over "
                 f"ranks and divided by the {cores} cores the ranks run on, the training time "
                 f"the writers take when training keeps every core busy (here "
                 f"{len(main['async_save']['writer_cpu_s'])} ranks on {cores} cores)")

    t = main["throughput"]
    parts.append("")
    parts.append(f"[3] write throughput at {main['label']} into {head['files']} "
                 f"({_mib(t['checkpoint_bytes'])} MiB each time, fsync'd; medians of "
                 f"{reps}, interleaved with the saves)")
    rows = []
    best = t["raw_best_Bps"]
    for key, label in (("raw_single_Bps", "raw write: 1 process, 1 file"),
                       ("raw_parallel_Bps", "raw write: each rank its own bytes, 1 file each"),
                       ("save_stock_Bps", "checkpoint save, stock"),
                       ("save_logical_Bps", "checkpoint save, logical")):
        frac = t[key] / best
        rows.append([label, f"{t[key] / 2**20:.0f}", f"{frac:.2f}",
                     _verdict(frac, TARGET_THROUGHPUT_FRACTION, at_most=False)
                     if key == "save_logical_Bps" else ""])
    parts.append(table(["write", "MiB/s", "of best raw", "target"], rows))
    return "\n".join(parts)


def main(argv=None) -> int:
    from benchmarks.train_speed import launch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_io",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default=None,
                        help="model preset (default gpt125m; tiny with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats of each measurement (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2 repeats, no padded-source save")
    parser.add_argument("--padded", action=argparse.BooleanOptionalAction, default=None,
                        help="also save at tp2 x g2/a40 (every gpt125m GTP weight padded); "
                             "default on, off with --quick")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="load a tp2 gtp-off checkpoint at tp1 too (megatron's own "
                             "cross-TP load; default on)")
    parser.add_argument("--targets", nargs="*", choices=list(TARGETS), default=list(TARGETS),
                        help="cross-layout load targets (none: saves and same-layout loads only)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPU cores / 4, at least 1)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    parser.add_argument("--out", default=None, help="output dir (default outputs/benchmarks/...)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    model = args.model or ("tiny" if args.quick else "gpt125m")
    repeats = args.repeats or (2 if args.quick else 5)
    padded = (not args.quick) if args.padded is None else args.padded
    out = Path(args.out or REPO / "outputs" / "benchmarks" / time.strftime("%Y-%m-%d_%H-%M-%S")
               / "checkpoint").resolve()
    files = out / "files"
    if files.exists():
        shutil.rmtree(files)
    files.mkdir(parents=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    os.environ["BENCH_THREADS"] = str(threads)
    os.environ.update(MALLOC_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sources = [SOURCE, *([PADDED_SOURCE] if padded else [])]
    src_name = SOURCE[0]
    command = " ".join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    print(f"> checkpoint: {model}, save at {', '.join(describe(*x[:3]) for _, x in sources)} "
          f"(world 4), cross-layout loads to "
          f"{', '.join(describe(*TARGETS[t][:3]) for t in args.targets)}; {repeats} interleaved "
          f"repeats, {os.cpu_count()} CPU cores, {threads} torch thread(s) per rank; writing {out}",
          flush=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    launches: dict[str, dict] = {}

    def run(name: str, tp, g, pad, world, bench):
        run_dir = out / "runs" / name
        cfg = compose_config(model, tp, g, pad, world, run_dir, out / "cache",
                             {**bench, "files": str(files), "repeats": repeats})
        t0, load0 = time.perf_counter(), os.getloadavg()
        res = launch(cfg, run_dir, world, module="benchmarks.checkpoint_io")
        launches[name] = {"wall_s": time.perf_counter() - t0, "load_average_start": load0,
                          "load_average_end": os.getloadavg()}
        print(f"  {name}: {res.get('error') or 'done'} ({time.perf_counter() - t0:.0f}s, load "
              f"average {os.getloadavg()[0]:.1f})", flush=True)
        return res

    save_res = {}
    for name, (tp, g, pad, world) in sources:
        res = run(f"save_{name}", tp, g, pad, world, {"phase": "save", "tag": name})
        if "error" in res:
            print(f"save launch failed: {res['error']}", flush=True)
            return 1
        res["label"] = describe(tp, g, pad)
        save_res[name] = res
    main_res = save_res[src_name]
    controls = {}
    if args.control and "tp1_off" in args.targets:
        name, (tp, g, pad, world) = CONTROL
        res = run(f"control_{name}", tp, g, pad, world,
                  {"phase": "save_only", "tag": f"control_{name}"})
        if "error" not in res:
            controls["control"] = res["source"]
        # Without padding rows the stock file holds the logical rows (gtp.legacy: not legacy),
        # so stock megatron can read it into a non-GTP model: a control for the file format.
        if not any(main_res["gtp_padding_rows"].values()):
            controls["stock_file"] = str(Path(main_res["source"]).parent / "save_stock")
    load_res = {}
    for name in args.targets:
        ttp, tg, tpad, tworld = TARGETS[name]
        load_res[name] = run(f"load_{name}", ttp, tg, tpad, tworld,
                             {"phase": "load", "target": name, "source": main_res["source"],
                              "controls": controls if name == "tp1_off" else {}})
    saves = {name: summarize_save(res) for name, res in save_res.items()}
    same_s = saves[src_name]["same_layout_load"]["logical"]["median_s"]
    summary = {"saves": saves,
               "cross_layout_load": {n: summarize_cross(r, n, same_s) for n, r in load_res.items()}}
    head = {"source_name": src_name, "repeats": repeats, "files": files}
    params = main_res["model_parameters"]
    load_end = os.getloadavg()
    intro = (f"checkpoint benchmark: {model} ({params / 1e6:.1f}M parameters; each checkpoint "
             f"holds "
             f"weights + Adam exp_avg + exp_avg_sq = {main_res['checkpoint_elements'] / 1e6:.1f}M "
             f"fp32 elements), {os.cpu_count()} CPU cores, load average {load_start[0]:.1f} at "
             f"start, {load_end[0]:.1f} at end; formats written: {main_res['gtp_format']}")
    tables = format_tables(summary, head)
    print("\n" + intro + "\n" + tables, flush=True)
    result = {
        "benchmark": "checkpoint", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": command,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch_threads_per_rank": threads,
                    "load_average_start": load_start, "load_average_end": load_end},
        "model": {"name": model, "parameters": params,
                  "checkpoint_elements": main_res["checkpoint_elements"]},
        "repeats": repeats,
        "targets": {"save_time_ratio_max": TARGET_SAVE_RATIO,
                    "peak_rss_ratio_max": TARGET_PEAK_RATIO,
                    "same_layout_load_ratio_max": TARGET_SAME_LOAD_RATIO,
                    "same_layout_load_extra_memory_fraction_max": TARGET_SAME_LOAD_EXTRA_MEMORY,
                    "cross_load_ratio_max": TARGET_LOAD_RATIO,
                    "write_fraction_of_raw_min": TARGET_THROUGHPUT_FRACTION,
                    "async_save_training_lost_ratio_max": TARGET_ASYNC_LOST_RATIO},
        "summary": summary,
        "launches": launches,
        "runs": {**{f"save_{k}": v for k, v in save_res.items()},
                 **{f"load_{k}": v for k, v in load_res.items()}},
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "table.txt").write_text(f"$ {command}\n{intro}\n{tables}\n")
    if not args.keep:  # checkpoints and the mock-data index cache (regenerated per run)
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(out / "cache", ignore_errors=True)
    print(f"> wrote {out / 'results.json'} ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return 1 if any("error" in r for r in load_res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
