"""What checkpoint integrity costs: loads with and without ``checkpoint.verify_on_load``, and
``python -m gtp verify``'s time, as ratios measured side by side in one launch.

    python -m benchmarks.checkpoint_verify            # gpt125m, tp2 x dp2 (world 4), 5 repeats
    python -m benchmarks.checkpoint_verify --quick    # tiny model, world 2, 2 repeats (~1 min)
    python -m benchmarks verify                       # the same, through the suite

One launch of worker processes (``benchmarks.train_speed.launch``) builds the model, DDP, Adam
and scheduler (``recipes.run.worker.setup``), runs one training step and saves once; then, in each
repeat, in turn (A B C D, D C B A, ...), each timed barrier to barrier on every rank
(``benchmarks.measure.measure``; a repeat counts its slowest rank):

* **load, verified**: ``ckpt.io.load_checkpoint(..., verify=True)`` (the default:
  each rank reads its share of the data files whole and checks every CRC-32 first);
* **load, not verified**: ``verify=False`` (the reader still checks the CRC-32 of each entry a
  read covers whole);
* **load, no CRC at all**: ``verify=False`` inside ``ckpt.format.dcp_reader.crc_unchecked`` (what a load
  cost before integrity checks);
* **verify, one process**: ``ckpt.verify.verify_iteration`` on rank 0 alone, as
  ``python -m gtp verify`` runs (every byte, the common state, in one process).

Saves write nothing more for integrity (the CRC-32s are ``torch.save``'s own, written
whatever this project does), so the table shows the save's time for scale only. The files are
in the page cache (just written), so the figures are CPU cost: reading from a cold disk adds
the same bytes once more per verified load. Output: a table on stdout, ``<out>/table.txt`` and
``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

CASES = ("load_verified", "load_unverified", "load_no_crc", "verify_one_process")


def _worker(cfg_path: str, out_path: str) -> None:
    import torch
    from megatron.core import parallel_state

    from benchmarks.measure import in_turn, measure
    from ckpt.format import dcp_reader
    from ckpt import verify
    from ckpt import io as checkpoint
    from benchmarks.runs import start_rank, trained_model

    cfg, rank, world, parallel_dims = start_rank(cfg_path, bench_threads=False)
    model, optimizer, scheduler, _ = trained_model(cfg, parallel_dims)  # Adam moments exist
    record = checkpoint.layout_record(parallel_dims)
    root = Path(cfg.bench.files)
    common = {"consumed_samples": cfg.data.global_batch_size, "wandb_run_id": None}
    save = measure(lambda: checkpoint.save_checkpoint(root, 1, model, optimizer, scheduler,
                                                       common, record))
    path = checkpoint.iter_dir(root, 1)

    def load(verified: bool, crc: bool = True):
        def run():
            if crc:
                checkpoint.load_checkpoint(root, model, optimizer, scheduler, record,
                                           verify=verified)
            else:
                with dcp_reader.crc_unchecked():
                    checkpoint.load_checkpoint(root, model, optimizer, scheduler, record,
                                               verify=False)
        return run

    def verify_alone():
        if rank == 0:
            report = verify.verify_iteration(path)
            assert not report.problems, report.problems[:3]

    fns = {"load_verified": load(True), "load_unverified": load(False),
           "load_no_crc": load(False, crc=False), "verify_one_process": verify_alone}
    for name in CASES:  # untimed warm-up of each code path
        fns[name]()
    times: dict[str, list] = {name: [] for name in CASES}
    for rep in range(int(cfg.bench.repeats)):
        for name in in_turn(CASES, rep):
            times[name].append(measure(fns[name]))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, {"save": save, "times": times})
    if rank == 0:
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        Path(out_path).write_text(json.dumps({"ranks": gathered, "checkpoint_bytes": size,
                                              "layout": parallel_dims.describe()}))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def summarize(res: dict) -> dict:
    """Per case: medians over repeats of the slowest rank's seconds; ratios to the unverified
    load, of medians and (in ``paired``) the median of per-repeat ratios."""
    ranks = res["ranks"]
    repeats = len(ranks[0]["times"][CASES[0]])
    per_rep = {name: [max(r["times"][name][i]["s"] for r in ranks) for i in range(repeats)]
               for name in CASES}
    base = per_rep["load_unverified"]
    out = {"checkpoint_bytes": res["checkpoint_bytes"], "layout": res["layout"],
           "save_s": max(r["save"]["s"] for r in ranks), "repeats": repeats, "cases": {}}
    for name in CASES:
        med = statistics.median(per_rep[name])
        out["cases"][name] = {
            "median_s": med, "min_s": min(per_rep[name]),
            "ratio": med / statistics.median(base),
            "paired": statistics.median(a / b for a, b in zip(per_rep[name], base))}
    return out


LABELS = {
    "load_verified": "load, checkpoint.verify_on_load=true (default)",
    "load_unverified": "load, verify_on_load=false (reader checks whole-entry reads)",
    "load_no_crc": "load, no CRC-32 checked at all (before this project checked any)",
    "verify_one_process": "python -m gtp verify's work, one process (every byte)",
}


def format_table(s: dict) -> str:
    mib = s["checkpoint_bytes"] / 2**20
    lines = [f"checkpoint: {mib:.1f} MiB at {s['layout']}; save {s['save_s']:.2f} s (integrity "
             f"adds nothing to it); medians of {s['repeats']} repeats, slowest rank",
             f"{'case':64s} {'s (min)':>14s} {'/ unverified':>13s} {'paired':>7s}"]
    for name in CASES:
        c = s["cases"][name]
        lines.append(f"{LABELS[name]:64s} {c['median_s']:6.2f} ({c['min_s']:.2f})"
                     f" {c['ratio']:12.2f}x {c['paired']:6.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.checkpoint_io_setup import compose_config
    from benchmarks.train_speed import launch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_verify",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, world 2, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    model = args.model or ("tiny" if args.quick else "gpt125m")
    repeats = args.repeats or (2 if args.quick else 5)
    world, tp = (2, 1) if args.quick else (4, 2)
    out = Path(args.out or Path("outputs") / "benchmarks" / time.strftime("%Y-%m-%d_%H-%M-%S")
               / "verify")
    out.mkdir(parents=True, exist_ok=True)
    files = out / "files"
    cfg = compose_config(model, tp, 1, None, world, out / "run", out / "cache",
                         {"files": str(files), "repeats": repeats})
    load0 = os.getloadavg()[0]
    res = launch(cfg, out / "run", world, module="benchmarks.checkpoint_verify")
    if not args.keep:
        shutil.rmtree(files, ignore_errors=True)
    if "error" in res:
        print(f"launch failed: {res['error']}", flush=True)
        return 1
    summary = summarize(res)
    summary.update(model=model, world=world, load_average_start=load0,
                   load_average_end=os.getloadavg()[0], machine=platform.platform(),
                   cores=os.cpu_count())
    table = format_table(summary)
    print(table, flush=True)
    (out / "table.txt").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"summary": summary, "raw": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
