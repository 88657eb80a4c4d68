"""Run the registered benchmarks: ``python -m benchmarks [NAME ...] [--quick] [--out DIR]``.

    python -m benchmarks                      # all of them (make bench)
    python -m benchmarks checkpoint           # only the checkpoint save/load benchmark
    python -m benchmarks --quick              # tiny model, 2 repeats each
    python -m benchmarks train_speed -- --g 1 2   # arguments after -- go to every benchmark

Add a benchmark by appending ``(name, module)`` to :data:`BENCHMARKS`; the module needs a
``main(argv) -> int`` that accepts ``--out DIR``, ``--quick`` and ``--repeats N``. Each writes
into ``<out>/<name>/`` (``results.json`` and its printed table); ``<out>`` defaults to
``outputs/benchmarks/<time>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

# (name, module with main(argv)); run in this order.
BENCHMARKS: list[tuple[str, str]] = [
    ("train_speed", "benchmarks.train_speed"),
    ("muon_speed", "benchmarks.muon_speed"),
    ("checkpoint", "benchmarks.checkpoint_io"),
    ("verify", "benchmarks.checkpoint_verify"),
    ("parallel_layouts", "benchmarks.parallel_layouts"),
    ("moe_dispatch", "benchmarks.moe_dispatch"),
    ("moe_checkpoint", "benchmarks.moe_checkpoint_io"),
    ("checkpoint_scale", "benchmarks.checkpoint_scale"),
    ("hf_import_memory", "benchmarks.hf_import_memory"),
    ("tools_memory", "benchmarks.tools_memory"),
    ("mamba_scan", "benchmarks.mamba_scan"),
    ("gated_delta_rule", "benchmarks.gated_delta_rule"),
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    names = [n for n, _ in BENCHMARKS]
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default all): {', '.join(names)}")
    parser.add_argument("--only", nargs="+", choices=names, help="same as NAME ...")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and 2 repeats in every benchmark (a minute or two each)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats per case, passed to every benchmark")
    parser.add_argument("--out", default=None,
                        help="output root (default outputs/benchmarks/<time>); each benchmark "
                             "writes into <out>/<name>/")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in BENCHMARKS:
            print(f"{name:16s} python -m {module}")
        return 0
    unknown = [n for n in args.names if n not in names]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {names}")
    selected = set(args.names) | set(args.only or [])
    passed = [*(["--quick"] if args.quick else []),
              *(["--repeats", str(args.repeats)] if args.repeats else [])]
    root = Path(args.out or Path("outputs") / "benchmarks" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    status = 0
    for name, module in BENCHMARKS:
        if selected and name not in selected:
            continue
        print(f"=== {name} ({module}) ===", flush=True)
        rc = importlib.import_module(module).main(["--out", str(root / name), *passed, *extra])
        status = status or rc
    print(f"> results under {root}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
