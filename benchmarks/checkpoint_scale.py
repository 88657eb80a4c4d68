"""What a save and a load cost each rank as the data-parallel size grows, per distributed-optimizer
checkpoint format (issue 55).

    python -m benchmarks.checkpoint_scale                 # 10M and 30M params, dp 1/2/4/8
    python -m benchmarks.checkpoint_scale --quick         # 2M params, dp 1/2/4, 1 repeat
    python -m benchmarks.checkpoint_scale --formats main fully_reshardable fully_sharded_model_space
    python -m benchmarks checkpoint_scale                 # the same, through the suite

One launch per model size and DP size (world = dp, tp1, gtp off, fp32, Adam,
``optim.use_distributed_optimizer=true``; torch's elastic launcher, as ``train.py``). Each rank
builds its model with ``recipes.run.worker.setup``, runs one training step (the Adam moments
exist), then ``--repeats`` times saves and loads a checkpoint in each format in turn (A B, B A,
...), every save and load through ``ckpt.io`` as the training loop calls it, each timed barrier
to barrier (``benchmarks.measure``). The formats (``--formats``):

* ``main``: megatron's ``fully_reshardable`` as the project ran it before issue 55: the whole
  optimizer state of the model-parallel group all-gathered to every DP rank at a save, written
  by DP rank 0 alone, and requested whole by every rank at a load (the benchmark reproduces the
  old writer and load request with two patches, ``checkpoint_scale_worker.as_format``);
* ``fully_reshardable``: the same file format with today's writers (replicas spread over the
  DP ranks) and loads (each rank requests its own ranges): ``optim.distrib_optim_sharding_type=
  fully_reshardable``;
* ``fully_sharded_model_space``: the default: each DP rank saves and loads its own range.

Per rank and operation: the peak resident memory (sampled every 1 ms) above the RSS right
before it (the steady state), bytes written (the size of the rank's ``__<rank>_0.distcp``),
bytes read (``rchar`` of ``/proc/self/io``: page-cache hits and gloo's socket reads included),
seconds. Each figure is the largest rank's (or the mean over ranks where named), the median over
repeats. Targets (issue 55), printed beside and not enforced: extra memory at most the rank's
own optimizer share plus the largest tensor; the largest rank's write at most 1.25x the mean;
each rank's read at most 1.1x what it keeps (all weights + its optimizer share). Workers run with
glibc's mmap threshold fixed (``benchmarks.memory.MALLOC_ENV``) so that freed buffers leave the
RSS. Output: the table on stdout, ``<out>/table.txt`` and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.memory import MALLOC_ENV
from benchmarks.runs import REPO, add_run_args, prepare_out, write_rows
from benchmarks.tables import table

# name -> (num_layers, hidden_size): gpt125m's shape made smaller (heads of 64, ffn 4x hidden).
SIZES = {"10m": (6, 384), "30m": (6, 640), "2m": (4, 192)}
TARGET_WRITE_RATIO = 1.25
TARGET_READ_RATIO = 1.1


def compose_config(size: str, dp: int, run_dir: Path, bench: dict):
    """The resolved run config of one launch: model ``size`` of :data:`SIZES`, world ``dp`` at
    tp1 with the distributed optimizer (Hydra compose, as train.py builds it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config.schema import register_configs

    layers, hidden = SIZES[size]
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "model=gpt125m", f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.num_attention_heads={hidden // 64}", f"model.ffn_hidden_size={4 * hidden}",
            "model.seq_length=32", "data=mock", "data.micro_batch_size=1",
            f"data.global_batch_size={dp}", "gtp=off", "parallelism=tp1",
            f"parallelism.nproc_per_node={dp}", "optim.use_distributed_optimizer=true",
            "checkpoint=none", "logger=none", f"output_dir={run_dir}",
            f"data.cache_dir={run_dir / 'cache'}", "train.train_iters=10",
            "optim.lr_warmup_iters=0"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["bench"] = bench
    return OmegaConf.create(plain)


def _median_of_max(ranks: list[dict], op: str, fmt: str, value) -> float:
    """Median over repeats of the largest rank's ``value(measurement)``."""
    repeats = len(ranks[0][op][fmt])
    return statistics.median(max(value(r[op][fmt][i]) for r in ranks) for i in range(repeats))


def summarize(res: dict, size: str, dp: int, fmt: str) -> dict:
    """One row: format ``fmt`` at model ``size`` and ``dp`` from a launch's result ``res``."""
    ranks, ck = res["ranks"], res["checkpoint"]
    extra = lambda m: m["rss_peak"] - m["rss_base"]  # noqa: E731
    written = [statistics.median(m["file_bytes"] for m in r["save"][fmt]) for r in ranks]
    own_optim = ck["optimizer_bytes"] / dp
    own_share = ck["model_bytes"] + own_optim
    row = {"format": fmt, "size": size, "dp": dp, **ck,
           "model_parameters": ranks[0]["local_param_numel"],
           "own_optimizer_bytes": own_optim, "own_share_bytes": own_share,
           "memory_target_bytes": own_optim + ck["largest_tensor_bytes"],
           "save_extra_rss_max": _median_of_max(ranks, "save", fmt, extra),
           "load_extra_rss_max": _median_of_max(ranks, "load", fmt, extra),
           "written_max": max(written), "written_mean": statistics.mean(written),
           "read_max": _median_of_max(ranks, "load", fmt, lambda m: m.get("rchar", 0)),
           "save_s": _median_of_max(ranks, "save", fmt, lambda m: m["s"]),
           "load_s": _median_of_max(ranks, "load", fmt, lambda m: m["s"])}
    row["write_ratio"] = row["written_max"] / row["written_mean"]
    row["read_ratio"] = row["read_max"] / own_share
    return row


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**20 * 10 else f"{n / 2**20:.1f}"


def _mark(ok: bool) -> str:
    return "" if ok else " !"


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per format x size x dp; ``!`` marks a figure over its target."""
    head = ["format", "size", "dp", "extra RSS save / load MiB (target)",
            "written MiB max / mean (max/mean <= 1.25)", "read MiB max (/ own share <= 1.1)",
            "save s", "load s"]
    out = []
    for r in rows:
        target = r["memory_target_bytes"]
        out.append([
            r["format"], f"{r['size']} ({r['model_parameters'] / 1e6:.1f}M)", str(r["dp"]),
            f"{_mib(r['save_extra_rss_max'])}{_mark(r['save_extra_rss_max'] <= target)} / "
            f"{_mib(r['load_extra_rss_max'])}{_mark(r['load_extra_rss_max'] <= target)} "
            f"(<= {_mib(target)})",
            f"{_mib(r['written_max'])} / {_mib(r['written_mean'])} ({r['write_ratio']:.2f}"
            f"{_mark(r['write_ratio'] <= TARGET_WRITE_RATIO)})",
            f"{_mib(r['read_max'])} ({r['read_ratio']:.2f}{_mark(r['read_ratio'] <= TARGET_READ_RATIO)}"
            f" of {_mib(r['own_share_bytes'])})",
            f"{r['save_s']:.2f}", f"{r['load_s']:.2f}"])
    return table(head, out)


def main(argv=None) -> int:
    from benchmarks.checkpoint_scale_worker import FORMATS
    from benchmarks.train_speed import launch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_scale",
                                     description=__doc__.split("\n\n")[0])
    add_run_args(parser, "2M params, dp 1/2/4, 1 repeat",
                 "interleaved saves and loads of each format per launch (default 2; 1 with --quick)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None,
                        help="model sizes (default 10m 30m; 2m with --quick)")
    parser.add_argument("--dp", nargs="+", type=int, default=None,
                        help="data-parallel sizes = world sizes (default 1 2 4 8; 1 2 4 with --quick)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS,
                        default=["main", "fully_sharded_model_space"], help="formats compared")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from benchmarks.checkpoint_scale_worker import worker

        worker(*args.worker)
        return 0
    sizes = args.sizes or (["2m"] if args.quick else ["10m", "30m"])
    dps = args.dp or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    repeats = args.repeats or (1 if args.quick else 2)
    out = prepare_out(args.out, "checkpoint_scale", args.threads)
    os.environ.update(MALLOC_ENV)
    print(f"> checkpoint_scale: sizes {sizes}, dp {dps}, formats {args.formats}, {repeats} "
          f"repeat(s), {os.cpu_count()} CPU cores; writing {out}", flush=True)
    t0 = time.perf_counter()
    rows, failed = [], []
    for size in sizes:
        for dp in dps:
            run_dir = out / "runs" / f"{size}_dp{dp}"
            files = out / "files" / f"{size}_dp{dp}"
            files.mkdir(parents=True, exist_ok=True)
            cfg = compose_config(size, dp, run_dir, {"files": str(files), "repeats": repeats,
                                                     "formats": list(args.formats)})
            t = time.perf_counter()
            res = launch(cfg, run_dir, dp, module="benchmarks.checkpoint_scale")
            shutil.rmtree(files, ignore_errors=True)
            shutil.rmtree(run_dir / "cache", ignore_errors=True)
            print(f"  {size} dp{dp}: {res.get('error') or 'done'} ({time.perf_counter() - t:.0f}s, "
                  f"load average {os.getloadavg()[0]:.1f})", flush=True)
            if "error" in res:
                failed.append(f"{size} dp{dp}")
                continue
            rows += [summarize(res, size, dp, fmt) for fmt in args.formats]
    rows.sort(key=lambda r: (r["size"], args.formats.index(r["format"]), r["dp"]))
    text = format_table(rows)
    command = " ".join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    print("\n" + text, flush=True)
    (out / "table.txt").write_text(f"$ {command}\n{text}\n")
    write_rows(out, "checkpoint_scale", rows, text)
    print(f"> wrote {out / 'results.json'} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
