"""MoE checkpoint save and load: the logical format against megatron-core 0.19.2's stock one,
side by side in one run.

    python -m benchmarks.moe_checkpoint_io            # moe_tiny widened, 5 interleaved repeats
    python -m benchmarks.moe_checkpoint_io --quick    # moe_tiny, 2 repeats
    python -m benchmarks moe_checkpoint               # the same, through the suite

One launch of 4 worker processes (``benchmarks.train_speed.launch``) at ep2 x expert GTP 2 with
``pad_for_alignment`` 16 (every expert fc1 and fc2 padded), fp32, Adam (moments initialised, as
after a step), built by ``recipes.run.worker.setup``. Each repeat, in turn (A B, B A, ...):

* save through ``ckpt.io.save_checkpoint`` in the logical format
  (``ckpt.format.logical_format.configure("logical")``) and in the stock one (``"stock"``);
* load the file just saved at the same layout with the format that wrote it (a stock file at its
  own layout is read as is, as megatron does).

Then once: the stock file loaded by the logical format at the same layout, which converts it
through ``ckpt.stock`` into ``<root>/gtp_converted`` (first load), and again (the conversion
reused). Every figure is one collective operation timed barrier to barrier on rank 0 (all ranks
have finished). Rows: medians over repeats and their ratio logical / stock (in parentheses the
median of the per-repeat ratios), the bytes on disk of each format. Figures depend on the machine
and its load; there is no threshold. Output: the table on stdout and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks import runs, tables, train_speed

WORLD = 4
LAYOUT = ("parallelism=tp1", f"parallelism.nproc_per_node={WORLD}",
          "parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
          "gtp.pad_for_alignment=16")
# Wider than moe_tiny (fc1 2 x 600 rows per expert, hidden 264: both padded at a16 x egtp2).
FULL_MODEL = ("model.hidden_size=264", "model.moe_ffn_hidden_size=600", "model.num_layers=4",
              "model.num_moe_experts=8")
FORMATS = ("logical", "stock")


def compose_config(run_dir: Path, cache: Path, quick: bool, repeats: int):
    """The benchmark's run config: moe_tiny (widened unless ``quick``) at the measured layout,
    mock data, ``repeats`` timed saves and loads per format."""
    cfg = train_speed.bench_config(["model=moe_tiny", "data=mock", *LAYOUT,
                                    *(() if quick else FULL_MODEL)], run_dir, cache, 1, 0)
    cfg.bench.repeats = repeats
    return cfg


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------
def _timed(fn) -> float:
    """Seconds of the collective ``fn()``, barrier to barrier."""
    import torch

    torch.distributed.barrier()
    t0 = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - t0


def _worker(cfg_path: str, out_path: str) -> None:
    import torch
    from omegaconf import OmegaConf

    from ckpt.format import logical_format
    from ckpt import io as checkpoint
    from recipes.config.validate import validate
    from recipes.run.worker import init_distributed, setup

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    cfg = OmegaConf.load(cfg_path)
    init_distributed()
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    _, model, opt, sched = setup(cfg, parallel_dims)
    for co in getattr(opt, "chained_optimizers", [opt]):
        co.init_state_fn(co.optimizer, co.config)  # Adam moments and step, as after a step
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                co.optimizer.state[p]["step"] = torch.tensor(1.0)
    record = checkpoint.layout_record(parallel_dims)
    root = Path(cfg.output_dir) / "files"
    state = {"consumed_samples": 0}
    rank = torch.distributed.get_rank()
    times: dict[str, list] = {f"{op} {fmt}": [] for op in ("save", "load") for fmt in FORMATS}

    def save(fmt, it):
        logical_format.configure(fmt)
        return _timed(lambda: checkpoint.save_checkpoint(root / fmt, it, model, opt, sched, state,
                                                         record))

    def load(fmt):
        logical_format.configure(fmt)
        return _timed(lambda: checkpoint.load_checkpoint(root / fmt, model, opt, sched, record))

    for fmt in FORMATS:  # untimed first save of each
        save(fmt, 1)
    for rep in range(int(cfg.bench.repeats)):
        order = FORMATS if rep % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            times[f"save {fmt}"].append(save(fmt, rep + 2))
        for fmt in order:
            times[f"load {fmt}"].append(load(fmt))
    sizes = {fmt: sum(f.stat().st_size for f in (root / fmt).rglob("*") if f.is_file()) //
             (int(cfg.bench.repeats) + 1) for fmt in FORMATS}
    # the stock file read by the logical format: converted once, then reused
    logical_format.configure("logical")
    convert = [_timed(lambda: checkpoint.load_checkpoint(root / "stock", model, opt, sched,
                                                         record)) for _ in range(2)]
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "bytes": sizes,
                                              "stock_converted": convert}))
        shutil.rmtree(root, ignore_errors=True)
    torch.distributed.barrier()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _ratio(a: list, b: list) -> str:
    med = statistics.median(a) / statistics.median(b)
    paired = statistics.median(x / y for x, y in zip(a, b))
    return f"{med:.2f}x ({paired:.2f}x)"


def format_table(res: dict, model: str) -> str:
    """The printed table of one run's results: seconds per save and load, logical and stock, and
    their ratio (logical / stock), measured side by side."""
    t = res["times"]
    rows = []
    for op in ("save", "load"):
        lo, st = t[f"{op} logical"], t[f"{op} stock"]
        rows.append([f"{op}, same layout", f"{statistics.median(lo):.3f}",
                     f"{statistics.median(st):.3f}", _ratio(lo, st)])
    first, again = res["stock_converted"]
    lo = statistics.median(t["load logical"])
    rows.append(["stock file -> logical load (ckpt.stock converts once)", f"{first:.3f}", "-",
                 f"{first / lo:.2f}x of a logical load"])
    rows.append(["  again (conversion reused)", f"{again:.3f}", "-",
                 f"{again / lo:.2f}x of a logical load"])
    b = res["bytes"]
    rows.append(["bytes per checkpoint (MiB)", f"{b['logical'] / 2**20:.2f}",
                 f"{b['stock'] / 2**20:.2f}", f"{b['logical'] / b['stock']:.2f}x"])
    head = [f"{model}, ep2 x egtp2/a16, world {WORLD}", "logical s", "stock s",
            "logical / stock (paired)"]
    return tables.table(head, rows)


def main(argv=None) -> int:
    """Command line: run the benchmark, print its table, write results.json; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_checkpoint_io",
                                     description=__doc__.split("\n\n")[0])
    runs.add_run_args(parser, "moe_tiny as is, 2 repeats", "interleaved repeats (5)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    repeats = args.repeats or (2 if args.quick else 5)
    out = runs.prepare_out(args.out, "moe_checkpoint", max(1, (os.cpu_count() or 1) // WORLD))
    model = "moe_tiny" if args.quick else "moe_tiny widened (" + ", ".join(FULL_MODEL) + ")"
    print(f"> moe_checkpoint: {model}, {repeats} interleaved repeats; writing {out}", flush=True)
    cfg = compose_config(out / "run", out / "cache", args.quick, repeats)
    res = train_speed.launch(cfg, out / "run", WORLD, module="benchmarks.moe_checkpoint_io")
    if "error" in res:
        print(f"  error: {res['error']}", flush=True)
        return 1
    table = format_table(res, "moe_tiny" if args.quick else "moe_tiny widened")
    print(table, flush=True)
    (out / "results.json").write_text(json.dumps({
        "benchmark": "moe_checkpoint", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": model, "load_average": os.getloadavg(), "repeats": repeats, **res,
        "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
