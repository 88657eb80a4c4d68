"""The sweep report's text table of final figures, one row per job."""

from __future__ import annotations

from recipes.metrics.logger import format_bytes

# (summary key, column head), in table order.
COLUMNS = [("job", "job"), ("layout", "layout"), ("final_iteration", "iter"),
            ("final_lm_loss", "lm loss"), ("final_grad_norm", "grad-norm"),
            ("median_tokens_per_sec", "tokens/s median (range)"),
            ("peak_memory_bytes", "peak memory"),
            ("max_loss_diff_vs_first", "max |d loss| vs 1st")]


def cell(summary_: dict, key: str) -> str:
    """The text of column ``key`` of one :func:`recipes.report.jobs.summary`."""
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
        return format_bytes(value)
    return str(value)


def format_table(summaries: list[dict]) -> str:
    """A fixed-width text table of :func:`summary` dicts."""
    cells = [[head for _, head in COLUMNS]]
    cells += [[cell(s, k) for k, _ in COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

