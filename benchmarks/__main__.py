"""Run every registered benchmark: ``python -m benchmarks [--only NAME ...] [--out DIR] [ARGS]``.

Add a benchmark by appending ``(name, module)`` to :data:`BENCHMARKS`; the module needs a
``main(argv) -> int`` that accepts ``--out DIR``. Arguments after ``--`` go to every benchmark.
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
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=[n for n, _ in BENCHMARKS],
                        help="run only these benchmarks")
    parser.add_argument("--out", default=None,
                        help="output root (default outputs/benchmarks/<time>); each benchmark "
                             "writes into <out>/<name>/")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in BENCHMARKS:
            print(f"{name:16s} python -m {module}")
        return 0
    root = Path(args.out or Path("outputs") / "benchmarks" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    status = 0
    for name, module in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        print(f"=== {name} ({module}) ===", flush=True)
        rc = importlib.import_module(module).main(["--out", str(root / name), *extra])
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
