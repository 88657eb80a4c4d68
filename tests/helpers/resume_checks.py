"""What the end-to-end resume tests compare: a run's metrics by iteration, and one resumed
iteration against the uninterrupted run's."""

from __future__ import annotations

from recipes.metrics import read_metrics
from tolerance import TINY, assert_fp32_close


def by_iteration(run_dir) -> tuple[dict, list]:
    """``({iteration: metrics row}, events)`` of the run in ``run_dir``."""
    rows, events = read_metrics(run_dir)
    return {r["iteration"]: r for r in rows}, events


def assert_same_step(resumed: dict, reference: dict, steps: int, terms: int = TINY) -> None:
    """``learning-rate`` and ``consumed-samples`` equal; ``lm loss`` and ``grad-norm`` within
    ``tolerance.fp32_rtol(steps, terms)``: ``steps`` is how many iterations ago both runs held the
    same weights (1 for the first iteration after a resume or from the same initial weights)."""
    assert resumed["learning-rate"] == reference["learning-rate"]
    assert resumed["consumed-samples"] == reference["consumed-samples"]
    for key in ("lm loss", "grad-norm"):
        assert_fp32_close(resumed[key], reference[key], steps, terms,
                          what=(key, resumed["iteration"]))


def resumed_rows(run_dir, resumed_at: int, iterations=(3, 4, 5)) -> dict:
    """``{iteration: metrics row}`` of a run resumed from ``resumed_at``, asserting it logged
    exactly ``iterations`` and that its first event is the resume from ``resumed_at``."""
    got, events = by_iteration(run_dir)
    assert sorted(got) == list(iterations), sorted(got)
    assert events[0]["event"] == "resume" and events[0]["iteration"] == resumed_at, events[:1]
    return got
