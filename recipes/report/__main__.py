"""``python -m recipes.report DIR ...``: the sweep report's command line
(:func:`recipes.report.report`)."""

from __future__ import annotations

import argparse
import sys

from recipes.report import ReportError, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.report",
        description="Draw grad-norm and lm loss per iteration of every job below DIR into one PNG "
                    "(resume points marked) and print a table of final figures.")
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="a multirun sweep dir, a job dir, or any folder above job dirs")
    parser.add_argument("-o", "--output", default=None,
                        help="PNG to write (default: DIR/report.png for one DIR, "
                             "else ./report.png)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--logy", action="store_true", help="log-scale grad-norm axis")
    args = parser.parse_args(argv)
    try:
        png, table, _ = report(args.dirs, args.output, title=args.title, logy=args.logy)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print(f"> wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

