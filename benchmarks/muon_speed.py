"""Muon against Adam: training step time at GTP degree g=1 and g=2, on CPU.

    python -m benchmarks.muon_speed                 # tiny and gpt125m, g 1 2, 2 repeats
    python -m benchmarks.muon_speed --quick         # tiny only

Each (model, g) runs ``optim=adam`` and ``optim=muon`` (conf/optim/muon.yaml: duplicated TP mode,
"highest" Newton-Schulz precision) at the same world size and global batch, one launch of a worker
group each (``benchmarks.train_speed``'s worker: ``recipes.run.worker.setup`` and
``recipes.run.loop.train_step``, timed steps after untimed warmup). Launches are interleaved (adam g1,
muon g1, adam g2, muon g2, ...) so that drifting machine load hits every case alike; the table
shows medians over repeats of each launch's median step time and Muon's step time as a ratio of
Adam's at the same g. At g=2 Muon all-gathers each GTP weight's momentum to orthogonalize the
whole matrix (gtp.muon). Figures depend on the machine and its load. Output: the table on stdout
and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from benchmarks import runs, tables
from benchmarks.train_speed import (CASES, DEFAULT_PAD, compose_config, launch,
                                     median_step, prepare_run)

OPTIMIZERS = ("adam", "muon")


def summarize(results: dict) -> list[dict]:
    """Rows ``{model, g, optimizer, median_step_s, vs_adam}`` from ``{(model, g, optimizer):
    [launch results]}``."""
    rows = []
    for (model, g, name), launches in results.items():
        ok = [r for r in launches if "error" not in r]
        row = {"model": model, "g": g, "optimizer": name}
        if not ok:
            row["error"] = launches[0]["error"] if launches else "no run"
        else:
            row.update(layout=ok[0]["layout"], runs=len(ok),
                       median_step_s=statistics.median(median_step(r) for r in ok),
                       step_s_per_run=[median_step(r) for r in ok],
                       final_loss=ok[0]["losses"][-1])
        rows.append(row)
    base = {(r["model"], r["g"]): r.get("median_step_s") for r in rows if r["optimizer"] == "adam"}
    for r in rows:
        adam = base.get((r["model"], r["g"]))
        if adam and r.get("median_step_s"):
            r["vs_adam"] = r["median_step_s"] / adam
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["model", "g", "optimizer", "layout", "step ms", "step time vs adam", "final loss"]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["model"], str(r["g"]), r["optimizer"], "error: " + r["error"], "", "",
                          ""])
            continue
        cells.append([r["model"], str(r["g"]), r["optimizer"], r["layout"],
                      f"{1000 * r['median_step_s']:.1f}", f"{r['vs_adam']:.2f}x",
                      f"{r['final_loss']:.4f}"])
    return tables.table(head, cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.muon_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--g", nargs="+", type=int, default=[1, 2], help="GTP degrees")
    runs.add_run_args(parser, "tiny model only (2 repeats)")
    parser.add_argument("--world", type=int, default=None, help="processes (default: max g)")
    parser.add_argument("--pad", type=int, default=DEFAULT_PAD, help="pad_for_alignment at g>1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPU cores / world, at least 1)")
    args = parser.parse_args(argv)
    if args.quick and args.models == list(CASES):
        args.models = ["tiny"]
    repeats = args.repeats or 2
    world, out, threads = prepare_run(parser, args, "muon_speed")
    print(f"> muon_speed: models {args.models}, g {args.g}, world {world}, {threads} torch "
          f"thread(s) per rank, {repeats} interleaved repeats; writing {out}", flush=True)
    results: dict = {}
    for model in args.models:
        for rep in range(repeats):
            for g in args.g:
                for name in OPTIMIZERS:
                    run_dir = out / "runs" / f"{model}_g{g}_{name}_r{rep}"
                    cfg = compose_config(model, g, world, args.pad, run_dir, out / "cache",
                                         extra=(f"optim={name}",))
                    t0 = time.perf_counter()
                    result = launch(cfg, run_dir, world)
                    results.setdefault((model, g, name), []).append(result)
                    what = result.get("error") or f"median step {1000 * median_step(result):.1f} ms"
                    print(f"  {model} g{g} {name} run {rep + 1}/{repeats}: {what} "
                          f"({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
    rows = summarize(results)
    table = format_table(rows)
    print(table, flush=True)
    (out / "results.json").write_text(json.dumps({
        "benchmark": "muon_speed", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_count": os.cpu_count(), "torch_threads_per_rank": threads, "world_size": world,
        "pad_for_alignment": args.pad, "repeats": repeats, "summary": rows}, indent=2))
    (out / "table.txt").write_text(table + "\n")
    import shutil

    shutil.rmtree(out / "cache", ignore_errors=True)
    print(f"> wrote {out / 'results.json'}", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
