"""The per-file time table of the test suite (``make test-times``).

A pytest plugin: with ``--time-table=FILE`` it sums, per test file, the wall time of every
test's set-up, call and tear-down, and the CPU time the whole machine spent meanwhile (from
``/proc/stat``: the test's own processes, its gloo ranks and ``train.py`` trees, and anything
else running; on an otherwise idle machine, the test's cost), then writes the table between
the markers below in FILE (``docs/testing.md``), largest wall time first. Session-scoped
fixtures are charged to the first test that uses them.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections import defaultdict
from pathlib import Path

BEGIN = "<!-- time-table: begin (written by make test-times) -->"
END = "<!-- time-table: end -->"


def machine_cpu_seconds() -> float:
    """CPU seconds (user + nice + system) all cores have spent since boot; 0.0 without
    ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:4]
    except OSError:
        return 0.0
    return sum(int(x) for x in fields) / os.sysconf("SC_CLK_TCK")


class TimeTable:
    """Collects per-file wall and machine CPU seconds; writes the table at session end."""

    def __init__(self, path: Path):
        self.path = path
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.started = time.monotonic()

    def pytest_runtest_protocol(self, item, nextitem):
        self._file = item.nodeid.split("::")[0]
        self._t0, self._c0 = time.monotonic(), machine_cpu_seconds()
        self.tests[self._file] += 1

    def pytest_runtest_logfinish(self, nodeid, location):
        self.wall[self._file] += time.monotonic() - self._t0
        self.cpu[self._file] += machine_cpu_seconds() - self._c0

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.wall:
            return
        total = time.monotonic() - self.started
        rows = sorted(self.wall, key=self.wall.get, reverse=True)
        lines = [
            f"Measured by `make test-times` on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
            f"{time.strftime('%Y-%m-%d')}: {sum(self.tests.values())} tests, "
            f"{total / 60:.1f} min wall, {sum(self.cpu.values()) / 60:.1f} min machine CPU.",
            "",
            "| file | tests | wall s | machine CPU s |",
            "|---|---:|---:|---:|",
            *(f"| `{f}` | {self.tests[f]} | {self.wall[f]:.0f} | {self.cpu[f]:.0f} |" for f in rows),
        ]
        text = self.path.read_text() if self.path.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in text or END not in text:
            text += f"\n{BEGIN}\n{END}\n"
        block = f"{BEGIN}\n" + "\n".join(lines) + f"\n{END}"
        self.path.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END),
                                    lambda _: block, text, flags=re.S))


def pytest_addoption(parser):
    parser.addoption("--time-table", metavar="FILE", default=None,
                     help="write the per-file wall and CPU time table into FILE's marked block")


def pytest_configure(config):
    path = config.getoption("--time-table")
    if path:
        config.pluginmanager.register(TimeTable(Path(path)), "time_table")
