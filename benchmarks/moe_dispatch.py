"""MoE training speed at expert parallel sizes 1, 2 and 4 with each token dispatcher, side by
side on CPU.

    python -m benchmarks.moe_dispatch             # moe_tiny, 2 repeats
    python -m benchmarks.moe_dispatch --quick     # fewer steps

Six cases on the same 4 processes and the same global batch (moe_tiny: 4 SwiGLU experts, top-2),
launched interleaved (ep1/allgather, ep1/alltoall, ep2/allgather, ... then again), each one
worker group of ``benchmarks.train_speed``'s worker (``recipes.run.worker.setup`` +
``recipes.run.loop.train_step``): tp1 x dp4, experts split over ``expert_model_parallel_size`` ranks,
tokens exchanged by megatron's ``allgather`` or ``alltoall`` dispatcher.

Rows: tokens/s, the ratio to ep1 with the same dispatcher and to allgather at the same EP, and
the parameter bytes per rank (experts / EP). Figures depend on the machine and its load; there
is no threshold. Output: the table on stdout and ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks import runs, tables, train_speed

WORLD = 4
EP_SIZES = (1, 2, 4)
DISPATCHERS = ("allgather", "alltoall")
CASES = [(ep, d) for ep in EP_SIZES for d in DISPATCHERS]
# (iterations timed, warm-up iterations)
STEPS = {"full": (6, 2), "quick": (3, 1)}


def case_name(ep: int, dispatcher: str) -> str:
    return f"ep{ep} {dispatcher}"


def compose_config(ep: int, dispatcher: str, run_dir: Path, cache: Path, steps: tuple[int, int]):
    """The resolved run config of one case (:func:`benchmarks.train_speed.bench_config`)."""
    iters, warmup = steps
    return train_speed.bench_config([
        "model=moe_tiny", "data=mock", "parallelism=tp1", f"parallelism.nproc_per_node={WORLD}",
        f"parallelism.expert_model_parallel_size={ep}",
        f"model.moe_token_dispatcher_type={dispatcher}", "data.global_batch_size=16",
    ], run_dir, cache, iters, warmup)


def format_table(rows: list[dict]) -> str:
    head = ["case", "layout", "tokens/s", "vs ep1 (same dispatcher)", "alltoall vs allgather",
            "param MiB per rank"]
    speed = {(r["ep"], r["dispatcher"]): r["tokens_per_sec"] for r in rows if "error" not in r}
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["case"], "error: " + r["error"], *[""] * 4])
            continue
        ep, d = r["ep"], r["dispatcher"]
        base = speed.get((1, d))
        other = speed.get((ep, "allgather"))
        cells.append([
            r["case"], r["layout"], f"{r['tokens_per_sec']:.0f}",
            f"{r['tokens_per_sec'] / base:.2f}x" if base else "-",
            f"{r['tokens_per_sec'] / other:.2f}x" if other and d == "alltoall" else "-",
            train_speed._mib(r["param_bytes_per_rank"]),
        ])
    return tables.table(head, cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_dispatch",
                                     description=__doc__.split("\n\n")[0])
    runs.add_run_args(parser, "fewer timed steps (2 repeats)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or 2
    steps = STEPS["quick" if args.quick else "full"]
    out = runs.prepare_out(args.out, "moe_dispatch", max(1, (os.cpu_count() or 1) // WORLD))
    names = [case_name(*c) for c in CASES]
    print(f"> moe_dispatch: moe_tiny, cases {names}, world {WORLD}, {args.repeats} interleaved "
          f"repeats; writing {out}", flush=True)
    raw: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for ep, d in CASES:
            run_dir = out / "runs" / f"ep{ep}_{d}_r{rep}"
            cfg = compose_config(ep, d, run_dir, out / "cache", steps)
            raw.setdefault((ep, d), []).append(train_speed.launch_case(
                cfg, run_dir, WORLD, f"{case_name(ep, d)} run {rep + 1}/{args.repeats}"))
    rows = []
    for ep, d in CASES:
        row = train_speed.summarize("moe_tiny", 0, raw[(ep, d)])
        row.pop("g", None)
        rows.append({**row, "case": case_name(ep, d), "ep": ep, "dispatcher": d})
    table = format_table(rows)
    print(table, flush=True)
    runs.write_rows(out, "moe_dispatch", rows, table)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
