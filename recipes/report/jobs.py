"""The sweep report's jobs: found below the given dirs, read from their metric logs
(``recipes.metrics.logger.read_metrics``; nothing touches the network), labelled by the overrides that
tell them apart, and summarised into final figures."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from recipes.metrics.logger import METRICS_FILE, read_metrics


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
            if row.get("iteration") == iteration and finite(row.get(key)):
                found = row[key]
        return found


def finite(x) -> bool:
    """``x`` is a finite int or float (not a bool, None or a string)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def describe_layout(layout: dict | None) -> str:
    """``tp2 x gtp2(pad 16) x dp1`` from a layout record (``ckpt.io.layout_record``)."""
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
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _read_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
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


def label_jobs(jobs: list[Job]) -> None:
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
            parent = parent_of(resumes[0].get("load"), jobs)
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


def parent_of(load: str | None, jobs: list[Job]) -> Job | None:
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
        vals = [r[TOKENS] for r in seg.rows if finite(r.get(TOKENS))]
        speeds += vals[1:] if len(vals) > 1 else vals
    diff = None
    if reference is not None and reference is not job:
        ref = {r["iteration"]: r[LM_LOSS] for r in reference.rows if finite(r.get(LM_LOSS))}
        common = [abs(r[LM_LOSS] - ref[r["iteration"]]) for r in rows
                  if finite(r.get(LM_LOSS)) and r["iteration"] in ref]
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
        "peak_memory_bytes": max((r[PEAK_MEMORY] for r in rows if finite(r.get(PEAK_MEMORY))),
                                 default=None),
        "max_loss_diff_vs_first": diff,
        "resumes": sum(1 for s in job.segments if s.resume),
        "path": str(job.path),
    }

