"""Sweep report: ``grad-norm`` and ``lm loss`` per iteration of many jobs in one PNG, plus a table.

    python -m recipes.report multirun/2025-11-30/08-50-00            # a Hydra multirun dir
    python -m recipes.report outputs/a outputs/b -o compare.png      # any job dirs
    python -m recipes.report multirun/... --logy                     # log-scale grad norm

A DIR is a job dir (it holds ``metrics.jsonl``) or any folder above job dirs (every
``metrics.jsonl`` below it is a job). Everything is read from the local metric logs
(``recipes.metrics.read_metrics``); nothing touches the network.

The figure has two panels (grad-norm, lm loss vs iteration), one line per job, labelled with the
overrides that tell the jobs apart (Hydra's ``.hydra/overrides.yaml``; the dir name otherwise)
and the layout the job ran at. Resume points (``resume`` events) are marked with a ring and the
layout resumed from. When a job resumed from a checkpoint written by another job of the report
(the event's ``load`` path lies in that job's dir), a dashed segment joins the parent's point at
the resume iteration to the child's first point, so a chain of resumes reads as one curve. The
table of final figures (job, layout, final iteration, final lm loss, final grad-norm, tokens/s
median (range), peak memory per rank) is printed and drawn under the panels, after one bar per
job of tokens/s and peak memory (what an alignment sweep compares). One iteration's tokens/s is
noise: the bar is the median over the job's iterations, its error bar their range (min to max).
Both leave out the first iteration of each start/resume (start-up), unless it is the only one.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from recipes.metrics import METRICS_FILE, read_metrics

GRAD_NORM, LM_LOSS, TOKENS = "grad-norm", "lm loss", "tokens-per-sec"
PEAK_MEMORY = "peak-memory-bytes"
# Hydra overrides that never tell jobs apart in a plot.
_IGNORED_OVERRIDE_PREFIXES = ("hydra.", "checkpoint.load", "checkpoint.save", "data.cache_dir",
                              "logger")


class ReportError(ValueError):
    """Nothing to report (no job dir found, unreadable file); the message says where."""


@dataclass
class Segment:
    """Rows logged between one start/resume and the next (one process group's life)."""

    rows: list[dict] = field(default_factory=list)
    resume: dict | None = None  # the resume event that began it, if any


@dataclass
class Job:
    """One job dir's metrics."""

    path: Path
    segments: list[Segment]
    overrides: list[str]
    layout: dict | None
    name: str = ""  # the overrides that tell this job apart (or the dir name)
    label: str = ""  # name and layout, for the legend

    @property
    def rows(self) -> list[dict]:
        return [r for s in self.segments for r in s.rows]

    def value_at(self, key: str, iteration: int) -> float | None:
        """The last logged ``key`` at ``iteration`` (later segments win)."""
        found = None
        for row in self.rows:
            if row.get("iteration") == iteration and _finite(row.get(key)):
                found = row[key]
        return found


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def describe_layout(layout: dict | None) -> str:
    """``tp2 x gtp2(pad 16) x dp1`` from a layout record (``recipes.checkpoint.layout_record``)."""
    if not layout:
        return "?"
    tp = layout.get("tensor_model_parallel_size", "?")
    g = layout.get("gtp_remat_size", 1)
    dp = layout.get("data_parallel_size", "?")
    gtp = f" x gtp{g}(pad {layout.get('pad_for_alignment', '?')})" if g and g > 1 else ""
    return f"tp{tp}{gtp} x dp{dp}"


def find_job_dirs(paths) -> list[Path]:
    """Job dirs (holding ``metrics.jsonl``) named by or found below ``paths``, in sorted order
    per argument, each once.

    Raises:
        ReportError: a path does not exist or has no ``metrics.jsonl`` at or below it.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ReportError(f"{raw}: no such file or directory")
        if path.is_file() and path.name == METRICS_FILE:
            path = path.parent
        if (path / METRICS_FILE).is_file():
            dirs = [path]
        else:
            dirs = sorted({p.parent for p in path.rglob(METRICS_FILE)}, key=_natural_key)
        if not dirs:
            raise ReportError(f"{raw}: no {METRICS_FILE} at or below it (not a job or sweep dir)")
        for d in dirs:
            if d.resolve() not in {f.resolve() for f in found}:
                found.append(d)
    return found


def _natural_key(path: Path):
    """Sort ``2_x`` before ``10_x`` (Hydra job numbers)."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _read_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    try:
        items = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - a broken file only costs the label
        return []
    return [str(o) for o in items or [] if not str(o).startswith(_IGNORED_OVERRIDE_PREFIXES)]


def load_job(job_dir: Path) -> Job:
    """Read one job dir: its metric rows split into start/resume segments, overrides, layout.

    A job dir normally holds one start or resume event and the rows after it. When several runs
    wrote into one dir (a crash and a restart, a resume into the same dir), each run is a
    segment: a new one begins where the iteration stops increasing, or, when a run continued
    exactly where the previous one stopped, at the next start/resume event's iteration.
    ``read_metrics`` returns rows and events apart, so events are matched to runs in order.
    """
    try:
        rows, events = read_metrics(job_dir)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{job_dir / METRICS_FILE}: {exc}") from None
    pending = [e for e in events if e.get("event") in ("start", "resume")]
    layout = next((e["layout"] for e in reversed(pending) if e.get("layout")), None)
    runs: list[list[dict]] = []
    for row in rows:
        if not isinstance(row.get("iteration"), int):
            continue
        if not runs or row["iteration"] <= runs[-1][-1]["iteration"]:
            runs.append([])
        runs[-1].append(row)

    def segment(seg_rows, event):
        return Segment(seg_rows, event if event and event.get("event") == "resume" else None)

    segments: list[Segment] = []
    for j, run in enumerate(runs):
        event = pending.pop(0) if pending else None
        # More events than runs left: a run that went on where the previous one stopped.
        while (pending and len(pending) > len(runs) - j - 1
               and run[0]["iteration"] <= pending[0].get("iteration", -1) < run[-1]["iteration"]):
            cut = pending[0]["iteration"]
            segments.append(segment([r for r in run if r["iteration"] <= cut], event))
            run = [r for r in run if r["iteration"] > cut]
            event = pending.pop(0)
        segments.append(segment(run, event))
    # Resume events with no row after them (a run that died at once) still mark the plot.
    segments += [Segment([], e) for e in pending if e.get("event") == "resume"]
    return Job(job_dir, segments, _read_overrides(job_dir), layout)


def _label_jobs(jobs: list[Job]) -> None:
    """Name each job by the overrides not shared by every job (its dir name when none), plus
    where it resumed from; jobs whose names still collide get their dir name in front. The label
    adds the layout."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if len(jobs) > 1 else set()
    for job in jobs:
        own = [o for o in job.overrides if o not in common]
        job.name = ",".join(own) if own else job.path.name
    for job in jobs:
        resumes = [seg.resume for seg in job.segments if seg.resume]
        if resumes:
            parent = _parent_of(resumes[0].get("load"), jobs)
            src = parent.name if parent is not None and parent is not job else (
                Path(resumes[0].get("load") or "?").parent.name)
            job.name += f" (resumed at {resumes[0].get('iteration')} from {src})"
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job.name] = counts.get(job.name, 0) + 1
    for job in jobs:
        if counts[job.name] > 1:
            job.name = f"{job.path.name}: {job.name}"
        job.label = f"{job.name} [{describe_layout(job.layout)}]"


def _parent_of(load: str | None, jobs: list[Job]) -> Job | None:
    """The job of the report whose dir holds the checkpoint dir ``load``."""
    if not load:
        return None
    try:
        target = Path(load).resolve()
    except OSError:
        return None
    best = None
    for job in jobs:
        root = job.path.resolve()
        if target == root or root in target.parents:
            if best is None or len(str(root)) > len(str(best.path.resolve())):
                best = job
    return best


def summary(job: Job, reference: Job | None = None) -> dict:
    """Final figures of one job: iteration, lm loss, grad-norm, tokens/s over its iterations
    (mean, median, min, max; the first iteration of each start/resume left out), peak memory,
    and the largest |lm loss difference| from ``reference`` over the iterations both logged."""
    rows = job.rows
    last = rows[-1] if rows else {}
    speeds = []
    for seg in job.segments:
        vals = [r[TOKENS] for r in seg.rows if _finite(r.get(TOKENS))]
        speeds += vals[1:] if len(vals) > 1 else vals
    diff = None
    if reference is not None and reference is not job:
        ref = {r["iteration"]: r[LM_LOSS] for r in reference.rows if _finite(r.get(LM_LOSS))}
        common = [abs(r[LM_LOSS] - ref[r["iteration"]]) for r in rows
                  if _finite(r.get(LM_LOSS)) and r["iteration"] in ref]
        diff = max(common) if common else None
    return {
        "job": job.name or job.path.name,
        "layout": describe_layout(job.layout),
        "final_iteration": last.get("iteration"),
        "final_lm_loss": last.get(LM_LOSS),
        "final_grad_norm": last.get(GRAD_NORM),
        "mean_tokens_per_sec": sum(speeds) / len(speeds) if speeds else None,
        # One iteration's speed is noise: the median and the range over iterations.
        "median_tokens_per_sec": statistics.median(speeds) if speeds else None,
        "min_tokens_per_sec": min(speeds, default=None),
        "max_tokens_per_sec": max(speeds, default=None),
        "peak_memory_bytes": max((r[PEAK_MEMORY] for r in rows if _finite(r.get(PEAK_MEMORY))),
                                 default=None),
        "max_loss_diff_vs_first": diff,
        "resumes": sum(1 for s in job.segments if s.resume),
        "path": str(job.path),
    }


_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]

_COLUMNS = [("job", "job"), ("layout", "layout"), ("final_iteration", "iter"),
            ("final_lm_loss", "lm loss"), ("final_grad_norm", "grad-norm"),
            ("median_tokens_per_sec", "tokens/s median (range)"),
            ("peak_memory_bytes", "peak memory"),
            ("max_loss_diff_vs_first", "max |d loss| vs 1st")]


def _cell(summary_: dict, key: str) -> str:
    if key == "median_tokens_per_sec" and summary_[key] is not None:
        return (f"{summary_[key]:.0f} ({summary_['min_tokens_per_sec']:.0f}-"
                f"{summary_['max_tokens_per_sec']:.0f})")
    return _fmt(key, summary_[key])


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key in ("final_lm_loss", "final_grad_norm"):
        return f"{value:.4f}"
    if key == "mean_tokens_per_sec":
        return f"{value:.0f}"
    if key == "max_loss_diff_vs_first":
        return f"{value:.1e}"
    if key == "peak_memory_bytes":
        from recipes.dry_run import format_bytes

        return format_bytes(value)
    return str(value)


def format_table(summaries: list[dict]) -> str:
    """A fixed-width text table of :func:`summary` dicts."""
    cells = [[head for _, head in _COLUMNS]]
    cells += [[_cell(s, k) for k, _ in _COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def draw(jobs: list[Job], out: Path, title: str | None = None, logy: bool = False) -> Path:
    """Draw :func:`figure` into ``out`` (PNG, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = figure(jobs, title=title, logy=logy)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def figure(jobs: list[Job], title: str | None = None, logy: bool = False):
    """The report's figure: the grad-norm and lm loss panels, the bars (tokens/s: median and
    range over iterations; peak memory), the legend and the table, one under the other
    (matplotlib's constrained layout keeps titles, tick and axis labels apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [summary(j, jobs[0]) for j in jobs]
    n = len(jobs)
    # Panels, then the legend (one line per job, plus the resume marker) and the table below
    # them, so that long labels never cover a curve.
    ncol = 1 if n <= 4 else 2
    legend_h = 0.22 * (math.ceil((n + 1) / ncol)) + 0.2
    table_h = 0.25 * (n + 1) + 0.1
    bars_h = 2.8
    fig = plt.figure(figsize=(14, 5.2 + bars_h + legend_h + table_h), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.08, hspace=0.04, wspace=0.04)
    grid = fig.add_gridspec(4, 2, height_ratios=[5.2, bars_h, legend_h, table_h])
    axes = {GRAD_NORM: fig.add_subplot(grid[0, 0]), LM_LOSS: fig.add_subplot(grid[0, 1])}
    colors = plt.get_cmap("tab10" if n <= 10 else "tab20")
    color_of = {id(job): colors(i % colors.N) for i, job in enumerate(jobs)}
    resume_marked: set[str] = set()
    for index, job in enumerate(jobs):
        color = color_of[id(job)]
        # Jobs that compute the same function draw the same curve: earlier jobs are drawn wider
        # and with their own marker so that coinciding lines stay visible.
        lw = 1.2 + 2.4 * (n - 1 - index) / max(n - 1, 1)
        marker = _MARKERS[index % len(_MARKERS)]
        for key, ax in axes.items():
            labelled = False
            for seg_index, seg in enumerate(job.segments):
                pts = [(r["iteration"], r[key]) for r in seg.rows if _finite(r.get(key))]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=color, lw=lw, alpha=0.85, marker=marker,
                            ms=3 + lw, markevery=max(1, len(pts) // 25), mfc="none",
                            label=None if labelled else job.label)
                    labelled = True
                if seg.resume is None:
                    continue
                it = seg.resume.get("iteration")
                # Where the run continued from: this job's own earlier segment, or the job whose
                # checkpoint it loaded.
                parent = _parent_of(seg.resume.get("load"), jobs)
                src = None
                if parent is not None and parent is not job:
                    src = parent.value_at(key, it)
                elif seg_index > 0:
                    prev = [r for s in job.segments[:seg_index] for r in s.rows]
                    src = next((r[key] for r in reversed(prev)
                                if r.get("iteration") == it and _finite(r.get(key))), None)
                if src is not None and pts:
                    ax.plot([it, pts[0][0]], [src, pts[0][1]], color=color, lw=1.2, ls="--")
                y = src if src is not None else (pts[0][1] if pts else None)
                if y is not None:
                    ax.plot([it], [y], ls="none", marker="o", ms=10, mfc="none", mec=color, mew=2,
                            label=None if key in resume_marked else "resume point")
                    resume_marked.add(key)
                    ax.annotate(f"resume from {describe_layout(seg.resume.get('from_layout'))}",
                                (it, y), textcoords="offset points", xytext=(6, 8),
                                fontsize=7, color=color)
                ax.axvline(it, color=color, lw=0.6, ls=":", alpha=0.7)
    for key, ax in axes.items():
        ax.set_title(key)
        ax.set_xlabel("iteration")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    if logy:
        axes[GRAD_NORM].set_yscale("log")
    _draw_bars(fig, grid, jobs, summaries, [color_of[id(j)] for j in jobs])
    lax = fig.add_subplot(grid[2, :])
    lax.axis("off")
    handles, labels = axes[LM_LOSS].get_legend_handles_labels()
    lax.legend(handles, labels, loc="center", ncol=ncol, fontsize=8, frameon=False)

    tax = fig.add_subplot(grid[3, :])
    tax.axis("off")
    table = tax.table(
        cellText=[[_cell(s, k) for k, _ in _COLUMNS] for s in summaries],
        colLabels=[head for _, head in _COLUMNS], loc="upper center", cellLoc="left",
        colLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(_COLUMNS))))
    for i, job in enumerate(jobs, start=1):
        table[i, 0].get_text().set_color(color_of[id(job)])
        table[i, 0].get_text().set_fontweight("bold")
    fig.suptitle(title or f"{n} job{'s' * (n != 1)}: grad-norm and lm loss per iteration",
                 fontsize=11)
    return fig


# The bars' titles; a test reads the figure by them.
TOKENS_TITLE = "tokens/s (global): median (range) over iterations"
MEMORY_TITLE = "peak memory per rank (MiB)"


def _draw_bars(fig, grid, jobs, summaries, colors) -> None:
    """One bar per job: the median tokens/s (global) over its iterations with their range (min
    to max) as error bars, and the peak memory per rank (MiB): what an alignment sweep compares.
    A job without the figure gets no bar."""
    names = [str(i + 1) for i in range(len(jobs))]
    ax = fig.add_subplot(grid[1, 0])
    nan = float("nan")  # no bar, no error bar
    med = [s["median_tokens_per_sec"] if s["median_tokens_per_sec"] is not None else nan
           for s in summaries]
    low = [s["min_tokens_per_sec"] if s["min_tokens_per_sec"] is not None else nan
           for s in summaries]
    high = [s["max_tokens_per_sec"] if s["max_tokens_per_sec"] is not None else nan
            for s in summaries]
    ax.bar(names, med, color=colors, yerr=[[m - lo for m, lo in zip(med, low)],
                                           [hi - m for m, hi in zip(med, high)]],
           capsize=4, error_kw={"lw": 1.2, "ecolor": "black"})
    ax.set_title(TOKENS_TITLE, fontsize=9)
    ax = fig.add_subplot(grid[1, 1], sharex=ax)
    ax.bar(names, [s["peak_memory_bytes"] * 2.0**-20 if s["peak_memory_bytes"] is not None
                   else nan for s in summaries], color=colors)
    ax.set_title(MEMORY_TITLE, fontsize=9)
    for ax in fig.axes[-2:]:
        ax.set_xlabel("job (table row)")
        ax.grid(True, axis="y", alpha=0.3)
        if not any(math.isfinite(p.get_height()) for p in ax.patches):
            ax.set_yticks([])  # an empty axis would show a made-up scale around 0
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", color="gray")


def report(paths, out: str | os.PathLike | None = None, title: str | None = None,
           logy: bool = False) -> tuple[Path, str, list[dict]]:
    """Find the jobs under ``paths``, draw ``out`` and return ``(png path, table text, summaries)``.

    ``out`` defaults to ``<DIR>/report.png`` for a single DIR argument, else ``./report.png``.
    """
    paths = [str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    jobs = [load_job(d) for d in find_job_dirs(paths)]
    _label_jobs(jobs)
    if out is None:
        only = Path(paths[0]) if len(paths) == 1 else None
        out = (only if only is not None and only.is_dir() else Path(".")) / "report.png"
    png = draw(jobs, Path(out), title=title, logy=logy)
    summaries = [summary(j, jobs[0]) for j in jobs]
    return png, format_table(summaries), summaries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.report",
        description="Draw grad-norm and lm loss per iteration of every job below DIR into one PNG "
                    "(resume points marked) and print a table of final figures.")
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="a multirun sweep dir, a job dir, or any folder above job dirs")
    parser.add_argument("-o", "--output", default=None,
                        help="PNG to write (default: DIR/report.png for one DIR, else ./report.png)")
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
