"""The sweep report's figure (matplotlib, Agg backend): grad-norm and lm loss per iteration,
resume points and the dashed joins of a resume chain, the tokens/s and peak-memory bars, the
legend and the table."""

from __future__ import annotations

import math
from pathlib import Path

from recipes.report.jobs import GRAD_NORM, LM_LOSS, Job, describe_layout, finite, parent_of, summary
from recipes.report.table import COLUMNS, cell

_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]

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
                pts = [(r["iteration"], r[key]) for r in seg.rows if finite(r.get(key))]
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
                parent = parent_of(seg.resume.get("load"), jobs)
                src = None
                if parent is not None and parent is not job:
                    src = parent.value_at(key, it)
                elif seg_index > 0:
                    prev = [r for s in job.segments[:seg_index] for r in s.rows]
                    src = next((r[key] for r in reversed(prev)
                                if r.get("iteration") == it and finite(r.get(key))), None)
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
        cellText=[[cell(s, k) for k, _ in COLUMNS] for s in summaries],
        colLabels=[head for _, head in COLUMNS], loc="upper center", cellLoc="left",
        colLoc="left",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(COLUMNS))))
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

