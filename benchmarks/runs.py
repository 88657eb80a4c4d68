"""What every launching benchmark sets up the same way: its ``--quick``/``--repeats``/``--out``
arguments, its output folder, the environment its launched ranks inherit, and (in a rank) the
model trained one step."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def add_run_args(parser, quick_help: str, repeats_help: str = "launches per case (default 2)"):
    """Add ``--quick`` (``store_true``, help ``quick_help``), ``--repeats N`` (default None: the
    benchmark's own) and ``--out DIR`` to the argparse ``parser``."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    parser.add_argument("--out", default=None, help="output dir (default outputs/benchmarks/...)")


def prepare_out(out: str | None, name: str, threads: int) -> Path:
    """The benchmark's output folder, created: ``out``, or ``outputs/benchmarks/<time>/<name>``
    under the repository; absolute. Sets what the launched ranks inherit: ``BENCH_THREADS``
    (torch threads per rank, ``threads``), ``PYTHONPATH`` (the repository first) and
    ``PYTHONWARNINGS=ignore`` unless set."""
    path = Path(out or REPO / "outputs" / "benchmarks" / time.strftime("%Y-%m-%d_%H-%M-%S")
                / name).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["BENCH_THREADS"] = str(threads)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    return path


def write_rows(out: Path, name: str, rows: list[dict], table: str) -> None:
    """Write ``<out>/results.json``: the benchmark ``name``, the time, its ``rows`` and printed
    ``table``."""
    (out / "results.json").write_text(json.dumps({
        "benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows,
        "table": table}, indent=1))


def write_results(out: Path, results, table: str) -> None:
    """Write ``results`` as ``<out>/results.json`` and the printed ``table`` as
    ``<out>/table.txt`` (``out`` created)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.txt").write_text(table + "\n")


def chunked_vs_loop(name: str, cases: dict, time_case, lengths, repeats: int, out: Path) -> int:
    """Time a chunked kernel against its naive loop, side by side: ``cases`` is ``{"chunked":
    fn, "loop": fn}``, ``time_case(fn, length)`` the seconds of one forward+backward at a
    sequence ``length``; one warm-up each, then ``repeats`` rounds alternating the cases. Prints
    the table of medians (and each over the chunked one's) and writes ``out``'s results."""
    import statistics

    from benchmarks import tables

    rows = []
    for length in lengths:
        for fn in cases.values():
            time_case(fn, length)  # warm-up
        times = {case: [] for case in cases}
        for _ in range(repeats):
            for case, fn in cases.items():
                times[case].append(time_case(fn, length))
        chunked = statistics.median(times["chunked"])
        for case in cases:
            median = statistics.median(times[case])
            rows.append({"length": length, "kernel": case, "median_s": median,
                         "vs_chunked": median / chunked, "runs": times[case]})
    table = tables.table(["length", "kernel", "forward+backward ms", "vs chunked"],
                         [[str(r["length"]), r["kernel"], f"{1000 * r['median_s']:.1f}",
                           f"{r['vs_chunked']:.2f}x"] for r in rows])
    print(table, flush=True)
    write_rows(out, name, rows, table)
    print(f"> wrote {out / 'results.json'}", flush=True)
    return 0


def start_rank(cfg_path: str, bench_threads: bool = True):
    """In one rank of a benchmark's gloo world: torch's threads set from ``BENCH_THREADS`` (when
    ``bench_threads`` and it is positive), the run config of ``cfg_path`` loaded, the process
    group joined (``recipes.run.worker.init_distributed``) and the config validated.

    Returns:
        ``(cfg, rank, world, parallel_dims)``.
    """
    import torch
    from omegaconf import OmegaConf

    from recipes.config.validate import validate
    from recipes.run.worker import init_distributed

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if bench_threads and threads > 0:
        torch.set_num_threads(threads)
    cfg = OmegaConf.load(cfg_path)
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return cfg, rank, world, validate(cfg, world)


def trained_model(cfg, parallel_dims):
    """In one rank of a benchmark's gloo world (``init_distributed`` called): the model of
    ``cfg`` at ``parallel_dims`` after one training step, so that the Adam moments exist.

    Returns:
        ``(model, optimizer, scheduler, step)``: ``step()`` runs one more training step on the
        same data iterator.
    """
    import torch
    from megatron.core import parallel_state

    from recipes.data import build_train_iterator
    from recipes.run.loop import train_step
    from recipes.run.worker import setup

    tokenizer, model, optimizer, scheduler = setup(cfg, parallel_dims)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank, dp_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    data = build_train_iterator(cfg, 0, dp_rank, dp_size, tokenizer=tokenizer)
    num_micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp_size)

    def step():
        train_step(model, optimizer, scheduler, data, num_micro, cfg)

    step()
    return model, optimizer, scheduler, step
