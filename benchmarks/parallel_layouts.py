"""Pipeline parallelism and the distributed optimizer, side by side on CPU.

    python -m benchmarks.parallel_layouts             # tiny and gpt125m, 2 repeats
    python -m benchmarks.parallel_layouts --quick     # tiny only

Three cases on the same 2 processes and the same global batch, launched interleaved
(dp2 pp2 dp2+distopt dp2 ...), each one worker group of ``benchmarks.train_speed``'s worker
(``recipes.run.worker.setup`` + ``recipes.run.loop.train_step``):

* ``pp1``: tp1 x dp2, megatron's non-distributed Adam;
* ``pp2``: tp1 x pp2 (1F1B), same Adam;
* ``pp1 distopt``: tp1 x dp2 with megatron's DistributedOptimizer.

Rows: tokens/s and peak RSS per rank (pp2 vs pp1), and the optimizer state each rank holds
(Adam moments and, with the distributed optimizer, its fp32 main-param shards; ~1/2 of the
non-distributed bytes at dp2 expected). Figures depend on the machine and its load; there is no
threshold. Output: the table on stdout and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks import runs, tables, train_speed

WORLD = 2
LAYOUTS: dict[str, list[str]] = {
    "pp1": ["parallelism=dp2"],
    "pp2": ["parallelism=pp2"],
    "pp1 distopt": ["parallelism=dp2", "optim.use_distributed_optimizer=true"],
}
MODELS: dict[str, tuple[list[str], int, int]] = {
    "tiny": (["model=tiny", "data=mock"], 10, 2),
    # 12 layers split 6 + 6 over two stages.
    "gpt125m": (["model=gpt125m", "model.seq_length=64", "data=mock", "data.micro_batch_size=1",
                 "data.global_batch_size=4"], 3, 1),
}


def compose_config(model: str, layout: str, run_dir: Path, cache: Path):
    """The resolved run config of one case (:func:`benchmarks.train_speed.bench_config`)."""
    overrides, iters, warmup = MODELS[model]
    return train_speed.bench_config([*overrides, *LAYOUTS[layout],
                                     f"parallelism.nproc_per_node={WORLD}"],
                                    run_dir, cache, iters, warmup)


def format_table(rows: list[dict]) -> str:
    head = ["model", "case", "layout", "tokens/s", "vs pp1", "peak RSS MiB per rank",
            "optimizer state MiB per rank", "vs pp1"]
    base = {r["model"]: r for r in rows if r["case"] == "pp1" and "error" not in r}
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["model"], r["case"], "error: " + r["error"], *[""] * 5])
            continue
        b = base.get(r["model"])
        speed = f"{r['tokens_per_sec'] / b['tokens_per_sec']:.2f}x" if b else "-"
        opt = r["optimizer_state_bytes_per_rank"]
        ratio = (f"{max(opt) / max(b['optimizer_state_bytes_per_rank']):.2f}x" if b else "-")
        cells.append([
            r["model"], r["case"], r["layout"], f"{r['tokens_per_sec']:.0f}", speed,
            " / ".join(f"{v / 2**20:.0f}" for v in r["peak_rss_bytes_per_rank"] if v),
            train_speed._mib(opt), ratio,
        ])
    return tables.table(head, cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel_layouts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    runs.add_run_args(parser, "tiny model only (2 repeats)")
    args = parser.parse_args(argv)
    if args.quick and args.models == list(MODELS):
        args.models = ["tiny"]
    args.repeats = args.repeats or 2
    out = runs.prepare_out(args.out, "parallel_layouts", max(1, (os.cpu_count() or 1) // WORLD))
    print(f"> parallel_layouts: models {args.models}, cases {list(LAYOUTS)}, world {WORLD}, "
          f"{args.repeats} interleaved repeats; writing {out}", flush=True)
    raw: dict[tuple[str, str], list[dict]] = {}
    for model in args.models:
        for rep in range(args.repeats):
            for case in LAYOUTS:
                run_dir = out / "runs" / f"{model}_{case.replace(' ', '_')}_r{rep}"
                cfg = compose_config(model, case, run_dir, out / "cache")
                raw.setdefault((model, case), []).append(train_speed.launch_case(
                    cfg, run_dir, WORLD, f"{model} {case} run {rep + 1}/{args.repeats}"))
    rows = []
    for model in args.models:
        for case in LAYOUTS:
            row = train_speed.summarize(model, 0, raw[(model, case)])
            row.pop("g", None)
            rows.append({**row, "case": case})
    table = format_table(rows)
    print(table, flush=True)
    runs.write_rows(out, "parallel_layouts", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
