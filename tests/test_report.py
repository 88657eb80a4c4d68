"""recipes.report on synthetic metric logs: job discovery, segments, resume chains, PNG, table."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.container import BarContainer

from recipes.report import (MEMORY_TITLE, TOKENS_TITLE, ReportError, figure, find_job_dirs,
                            load_job, report)
from recipes.report.__main__ import main
from recipes.report.jobs import label_jobs, parent_of

REPO = Path(__file__).resolve().parents[1]


def layout(tp=1, g=1, dp=2, pad=0):
    return {"world_size": tp * g * dp, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": 1, "gtp_remat_size": g, "data_parallel_size": dp,
            "pad_for_alignment": pad, "megatron_core": "0.19.2"}


def row(it, loss, gn=1.0, tps=1000.0):
    return {"iteration": it, "lm loss": loss, "grad-norm": gn, "num-zeros": 0.0,
            "learning-rate": 1e-3, "iteration-time": 0.1, "tokens-per-sec": tps,
            "consumed-samples": 16 * it}


def write_job(job_dir: Path, records, overrides=()):
    job_dir.mkdir(parents=True)
    with open(job_dir / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    (job_dir / ".hydra").mkdir()
    (job_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides))


@pytest.fixture
def sweep(tmp_path):
    return make_sweep(tmp_path)


def make_sweep(tmp_path: Path) -> Path:
    """A multirun dir: job 0 trains 1..10 at dp2 and saves; job 1 at gtp2 trains 1..10; job 2
    resumes job 0's iteration 6 checkpoint at gtp2 and trains 7..10."""
    root = tmp_path / "multirun" / "10-00-00"
    common = ["train.train_iters=10", "logger=none"]
    a = root / "0_gtp=off"
    write_job(a, [{"event": "start", "iteration": 0, "layout": layout()}]
              + [row(i, 6 - 0.3 * i, 2.0 / i, tps=500 if i == 1 else 1000) for i in range(1, 11)]
              + [{"event": "save", "iteration": 10, "path": str(a / "checkpoints/iter_0000010")}],
              ["gtp=off", *common])
    write_job(root / "1_gtp=tp2_align16",
              [{"event": "start", "iteration": 0, "layout": layout(g=2, dp=1, pad=16)}]
              + [row(i, 6 - 0.3 * i + 1e-7, 2.0 / i, tps=800) for i in range(1, 11)],
              ["gtp=tp2_align16", *common])
    write_job(root / "2_resume",
              [{"event": "resume", "iteration": 6, "from_layout": layout(),
                "layout": layout(g=2, dp=1, pad=16), "load": str(a / "checkpoints")}]
              + [row(i, 6 - 0.3 * i, 2.0 / i) for i in range(7, 11)],
              ["gtp=tp2_align16", f"checkpoint.load={a}/checkpoints", *common])
    return root


def test_finds_every_job_below_a_sweep_dir_in_job_order(sweep, tmp_path):
    (sweep / "10_late").mkdir()
    (sweep / "10_late" / "metrics.jsonl").write_text(json.dumps(row(1, 5.0)) + "\n")
    names = [d.name for d in find_job_dirs([sweep])]
    assert names == ["0_gtp=off", "1_gtp=tp2_align16", "2_resume", "10_late"]
    # Job dirs given directly, a duplicate, and a metrics.jsonl path.
    got = find_job_dirs([sweep / "2_resume", sweep / "0_gtp=off" / "metrics.jsonl", sweep / "2_resume"])
    assert [d.name for d in got] == ["2_resume", "0_gtp=off"]
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        find_job_dirs([tmp_path / "multirun" / "10-00-00" / "0_gtp=off" / ".hydra"])
    with pytest.raises(ReportError, match="no such file"):
        find_job_dirs([tmp_path / "nope"])


def test_png_and_table(sweep, tmp_path):
    png, table, summaries = report([sweep], tmp_path / "out" / "r.png")
    assert png == tmp_path / "out" / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # Labels: the overrides that differ between jobs (common ones and checkpoint paths dropped),
    # and where a job resumed from.
    assert [s["job"] for s in summaries] == [
        "gtp=off", "gtp=tp2_align16", "gtp=tp2_align16 (resumed at 6 from gtp=off)"]
    first, gtp, resumed = summaries
    assert (first["job"], first["layout"], first["final_iteration"]) == ("gtp=off", "tp1 x dp2", 10)
    assert first["final_lm_loss"] == pytest.approx(3.0)
    assert first["final_grad_norm"] == pytest.approx(0.2)
    # The first iteration of a start is left out of the mean speed.
    assert first["mean_tokens_per_sec"] == pytest.approx(1000.0)
    assert gtp["layout"] == "tp1 x gtp2(pad 16) x dp1"
    assert gtp["max_loss_diff_vs_first"] == pytest.approx(1e-7, rel=1e-3)
    assert resumed["resumes"] == 1 and resumed["final_iteration"] == 10
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["job", "layout", "iter", "lm"]
    assert len(lines) == 2 + 3
    assert "tp1 x gtp2(pad 16) x dp1" in lines[3] and "3.0000" in lines[2]


def test_resume_segments_and_parent_link(sweep):
    jobs = [load_job(d) for d in find_job_dirs([sweep])]
    resumed = jobs[2]
    assert len(resumed.segments) == 1 and resumed.segments[0].resume["iteration"] == 6
    assert parent_of(resumed.segments[0].resume["load"], jobs) is jobs[0]
    assert jobs[0].value_at("lm loss", 6) == pytest.approx(6 - 1.8)


def test_one_dir_written_by_two_runs_splits_into_segments(tmp_path):
    job = tmp_path / "job"
    write_job(job, [{"event": "start", "iteration": 0, "layout": layout()}]
              + [row(i, 5.0 - i * 0.1) for i in range(1, 9)]
              + [{"event": "resume", "iteration": 4, "from_layout": layout(),
                  "layout": layout(tp=2, dp=1), "load": str(job / "checkpoints")}]
              + [row(i, 5.0 - i * 0.1) for i in range(5, 11)])
    loaded = load_job(job)
    assert [len(s.rows) for s in loaded.segments] == [8, 6]
    assert loaded.segments[1].resume["iteration"] == 4
    assert loaded.layout["tensor_model_parallel_size"] == 2  # the latest run's layout
    png, _, summaries = report([job], tmp_path / "j.png")
    assert png.exists() and summaries[0]["final_iteration"] == 10


def test_cli_writes_into_the_sweep_dir_by_default(sweep, capsys):
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert (sweep / "report.png").is_file()
    assert f"> wrote {sweep / 'report.png'}" in out and "gtp=tp2_align16" in out
    assert main([str(sweep / "missing")]) == 2


def test_module_entry_point(sweep, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "recipes.report", str(sweep), "-o",
                           str(tmp_path / "cli.png"), "--logy"], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert (tmp_path / "cli.png").is_file()


def test_a_run_that_went_on_where_the_previous_stopped_is_its_own_segment(tmp_path):
    job = tmp_path / "job"
    write_job(job, [{"event": "start", "iteration": 0, "layout": layout()}]
              + [row(i, 5.0) for i in range(1, 5)]
              + [{"event": "resume", "iteration": 4, "from_layout": layout(),
                  "layout": layout(g=2, dp=1, pad=16), "load": str(job / "checkpoints")}]
              + [row(i, 4.0) for i in range(5, 9)])
    loaded = load_job(job)
    assert [[r["iteration"] for r in s.rows] for s in loaded.segments] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [s.resume is not None for s in loaded.segments] == [False, True]


def test_bars_of_tokens_per_sec_and_peak_memory_per_job(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    root = tmp_path / "sweep"
    for i, (tps, peak) in enumerate(((1000.0, 3 * 2**20), (600.0, 5 * 2**20))):
        write_job(root / f"{i}_gtp.pad_for_alignment={16 * (i + 1)}",
                  [{"event": "start", "iteration": 0, "layout": layout(g=2, dp=1, pad=16)}]
                  + [{**row(it, 5.0, tps=tps), "peak-memory-bytes": peak - (3 - it) * 1024}
                     for it in (1, 2, 3)],
                  [f"gtp.pad_for_alignment={16 * (i + 1)}"])
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    _, table, summaries = report([root], tmp_path / "r.png")
    assert [s["peak_memory_bytes"] for s in summaries] == [3 * 2**20, 5 * 2**20]
    assert "peak memory" in table.splitlines()[0] and "5.00 MiB" in table
    bars = {ax.get_title(): [p.get_height() for p in ax.patches] for ax in figures[0].axes
            if ax.patches}
    assert bars[TOKENS_TITLE] == [1000.0, 600.0]
    assert bars[MEMORY_TITLE] == [3.0, 5.0]


def test_tokens_per_sec_bars_are_the_median_with_the_range_over_iterations(tmp_path):
    """One iteration's speed is noise: each bar is the median over the job's iterations and its
    error bar their range, the first iteration of each start/resume (start-up) left out."""
    speeds = {"0_a": [90.0, 1000.0, 1400.0, 900.0, 1100.0, 950.0],
              "1_b": [50.0, 700.0, 620.0, 800.0, 2000.0]}
    root = tmp_path / "sweep"
    for name, tps in speeds.items():
        write_job(root / name, [{"event": "start", "iteration": 0, "layout": layout()}]
                  + [row(i, 5.0, tps=t) for i, t in enumerate(tps, start=1)], [name])
    # A resume: its first iteration (start-up again) is left out too.
    with open(root / "1_b" / "metrics.jsonl", "a") as f:
        for rec in ({"event": "resume", "iteration": 5, "layout": layout(), "from_layout": layout(),
                     "load": str(root / "1_b" / "checkpoints")}, row(6, 5.0, tps=10.0),
                    row(7, 5.0, tps=750.0)):
            f.write(json.dumps(rec) + "\n")
    kept = {"0_a": speeds["0_a"][1:], "1_b": speeds["1_b"][1:] + [750.0]}
    jobs = [load_job(d) for d in find_job_dirs([root])]
    label_jobs(jobs)
    fig = figure(jobs)
    ax = next(a for a in fig.axes if a.get_title() == TOKENS_TITLE)
    bars = next(c for c in ax.containers if isinstance(c, BarContainer))
    want = [statistics.median(kept[name]) for name in ("0_a", "1_b")]
    assert [p.get_height() for p in bars.patches] == pytest.approx(want)
    # The error bars' vertical segments: from the min to the max of each job.
    segments = bars.errorbar.lines[2][0].get_segments()
    assert [v for seg in segments for v in (seg[0][1], seg[1][1])] == pytest.approx(
        [v for name in ("0_a", "1_b") for v in (min(kept[name]), max(kept[name]))])
    # No peak memory logged: no made-up scale, a word.
    memory = next(a for a in fig.axes if a.get_title() == MEMORY_TITLE)
    assert [t.get_text() for t in memory.texts] == ["not logged"] and not memory.get_yticks().size
    _, table, summaries = report([root], tmp_path / "r.png")
    assert [s["median_tokens_per_sec"] for s in summaries] == pytest.approx(want)
    assert "tokens/s median (range)" in table.splitlines()[0]
    assert f"{want[0]:.0f} (900-1400)" in table and f"{want[1]:.0f} (620-2000)" in table


def _texts(ax, renderer) -> list:
    """The window extents of what ``ax`` shows: its frame, title, and each axis with its tick
    labels and label (an axes turned off: its legend or table)."""
    if not ax.axison:
        return [a.get_window_extent(renderer) for a in [ax.get_legend(), *ax.tables] if a]
    return [ax.bbox, ax.title.get_window_extent(renderer), ax.xaxis.get_tightbbox(renderer),
            ax.yaxis.get_tightbbox(renderer)]


@pytest.mark.parametrize("n", [2, 6, 12])
def test_nothing_of_one_panel_overlaps_another_at_2_to_12_jobs(tmp_path, n):
    """Titles, tick and axis labels, the legend and the table: no two panels' overlap (the
    iteration labels of the curves once covered the bar charts' titles)."""
    root = tmp_path / "sweep"
    for j in range(n):
        pad = 16 * (j + 1)
        write_job(root / f"{j}_pad={pad}",
                  [{"event": "start", "iteration": 0, "layout": layout(g=2, dp=1, pad=pad)}]
                  + [{**row(i, 6 - 0.02 * i, 2.0 / i, tps=900 + 37 * ((i * j) % 7)),
                      "peak-memory-bytes": (300 + 10 * j) * 2**20} for i in range(1, 41)],
                  [f"gtp.pad_for_alignment={pad}", "parallelism=tp2", "train.train_iters=40"])
    jobs = [load_job(d) for d in find_job_dirs([root])]
    label_jobs(jobs)
    fig = figure(jobs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [_texts(ax, renderer) for ax in fig.axes]
    assert len(fig.axes) == 6 and all(boxes)
    for i, j in itertools.combinations(range(len(boxes)), 2):
        for a, b in itertools.product(boxes[i], boxes[j]):
            assert not a.overlaps(b), (fig.axes[i].get_title(), fig.axes[j].get_title(), a, b)
    top = fig._suptitle.get_window_extent(renderer)
    assert not any(top.overlaps(b) for box in boxes for b in box)
