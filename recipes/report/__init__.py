"""Sweep report: ``grad-norm`` and ``lm loss`` per iteration of many jobs in one PNG, plus a table.
Not part of a run: it reads the metric logs that runs leave (the jobs in :mod:`.jobs`, the table
in :mod:`.table`, the figure in :mod:`.figure`, the command line in ``__main__.py``).

    python -m recipes.report multirun/2025-11-30/08-50-00            # a Hydra multirun dir
    python -m recipes.report outputs/a outputs/b -o compare.png      # any job dirs
    python -m recipes.report multirun/... --logy                     # log-scale grad norm

A DIR is a job dir (it holds ``metrics.jsonl``) or any folder above job dirs (every
``metrics.jsonl`` below it is a job). Everything is read from the local metric logs
(``recipes.metrics.logger.read_metrics``); nothing touches the network.

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

import os
from pathlib import Path

from recipes.report.figure import MEMORY_TITLE, TOKENS_TITLE, draw, figure
from recipes.report.jobs import (Job, ReportError, Segment, find_job_dirs, label_jobs, load_job,
                                 summary)
from recipes.report.table import format_table

__all__ = ["MEMORY_TITLE", "TOKENS_TITLE", "Job", "ReportError", "Segment", "draw", "figure",
           "find_job_dirs", "format_table", "load_job", "report", "summary"]


def report(paths, out: str | os.PathLike | None = None, title: str | None = None,
           logy: bool = False) -> tuple[Path, str, list[dict]]:
    """Find the jobs under ``paths``, draw ``out`` and return ``(png path, table text, summaries)``.

    ``out`` defaults to ``<DIR>/report.png`` for a single DIR argument, else ``./report.png``.
    """
    paths = [str(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    jobs = [load_job(d) for d in find_job_dirs(paths)]
    label_jobs(jobs)
    if out is None:
        only = Path(paths[0]) if len(paths) == 1 else None
        out = (only if only is not None and only.is_dir() else Path(".")) / "report.png"
    png = draw(jobs, Path(out), title=title, logy=logy)
    summaries = [summary(j, jobs[0]) for j in jobs]
    return png, format_table(summaries), summaries

