"""Checkpoint save and load: the logical GTP format (gtp/ on) against megatron-core 0.19.2's.

    python -m benchmarks.checkpoint_io                 # gpt125m, 5 interleaved repeats
    python -m benchmarks.checkpoint_io --quick         # tiny model, 2 repeats
    python -m benchmarks.checkpoint_io --repeats 9 --no-padded --out outputs/bench
    python -m benchmarks checkpoint                    # the same, through the suite

Launches of worker processes (torch's elastic launcher, as ``train.py``); each builds its model,
DDP, Adam and scheduler with ``recipes.run.worker.setup`` and runs one training step, so every
checkpoint holds the Adam moments:

1. **Save** at the source layout ``tp2 x g2/a16`` (world 4), in one process group, ``--repeats``
   times: save in the logical format (``ckpt.format.logical_format.configure("logical")``) and in
   the stock format (``"stock"``: megatron 0.19.2 as shipped), in turn (A B, B A, ...), raw write
   with every rank writing the bytes it wrote in the save to one file, raw write with rank 0 writing
   all the bytes to one file (plain ``open``/``write`` of 8 MiB blocks, then ``os.fsync`` as
   megatron's writer ends each file). One untimed save of each format comes first. Then same-layout
   loads, in turn: the logical file, the stock file. gpt125m's TP-local GTP dims (1152, 768, 1536,
   160) are multiples of 32, so a16 pads nothing; a second save launch at ``tp2 x g2/a40``
   (``--padded``, default on, off with ``--quick``) pads every GTP weight, where the logical format
   writes trimmed views of the padded shards.
2. **Cross-layout load** of the source's logical file to ``tp1, gtp off`` (world 1) and to
   ``tp1 x g4/a32`` (world 4): each launch first saves a checkpoint at its own layout, then
   alternates loading the source (cross-layout) with loading its own file (same-layout at that
   layout: the baseline with the same world size and bytes per rank). With ``--control``
   (default) the tp1 launch also loads a checkpoint saved at ``tp2, gtp off`` (world 2):
   megatron's own cross-TP resharding, no GTP anywhere. Every target also loads the source's
   logical file with torch's own ``FileSystemReader.read_data`` (``ckpt.format.dcp_reader.disabled``),
   which reads each stored chunk whole, beside ``ckpt.format.dcp_reader``, which reads the requested
   rows only. The stock source file is not loaded
   cross-layout: stock megatron-core 0.19.2 cannot (its padded GTP format is the bug ``gtp/``
   fixes; ``gtp/stock`` converts such a file once instead).
3. **Write throughput**: checkpoint bytes / save seconds next to the raw writes of step 1 (same
   directory, same bytes, same run).
4. **Asynchronous save** (``checkpoint.async_save``): in each repeat of step 1, after the
   synchronous saves, a logical save through ``ckpt.io.AsyncSaves``. What it costs
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
(``save_checkpoint`` / ``load_checkpoint`` of ``ckpt.io`` as the training loop calls
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
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks.checkpoint_io_report import format_tables, summarize_cross, summarize_save
from benchmarks.checkpoint_io_setup import (CONTROL, MODELS, PADDED_SOURCE, SOURCE,
                                            TARGET_ASYNC_LOST_RATIO, TARGET_LOAD_RATIO,
                                            TARGET_PEAK_RATIO, TARGET_SAME_LOAD_EXTRA_MEMORY,
                                            TARGET_SAME_LOAD_RATIO, TARGET_SAVE_RATIO,
                                            TARGET_THROUGHPUT_FRACTION, TARGETS, compose_config,
                                            describe)
from benchmarks.memory import MALLOC_ENV
from benchmarks.runs import prepare_out


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
        from benchmarks.checkpoint_io_worker import worker

        worker(*args.worker)
        return 0
    model = args.model or ("tiny" if args.quick else "gpt125m")
    repeats = args.repeats or (2 if args.quick else 5)
    padded = (not args.quick) if args.padded is None else args.padded
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    out = prepare_out(args.out, "checkpoint", threads)
    os.environ.update(MALLOC_ENV)
    files = out / "files"
    if files.exists():
        shutil.rmtree(files)
    files.mkdir(parents=True)
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
        # Without padding rows the stock file holds the logical rows (ckpt.stock: not stock),
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
