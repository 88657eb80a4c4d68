"""What the end-to-end resume tests compare: a run's metrics by iteration, and one resumed
iteration against the uninterrupted run's."""

from __future__ import annotations

import math

from recipes.metrics import read_metrics

# Layouts differ only in reduction order (fp32): tests/test_resume.py gives the argument.
RTOL = 1e-5


def by_iteration(run_dir) -> tuple[dict, list]:
    """``({iteration: metrics row}, events)`` of the run in ``run_dir``."""
    rows, events = read_metrics(run_dir)
    return {r["iteration"]: r for r in rows}, events


def assert_same_step(resumed: dict, reference: dict, rtol: float = RTOL) -> None:
    """``learning-rate`` and ``consumed-samples`` equal; ``lm loss`` and ``grad-norm`` within
    relative ``rtol``."""
    assert resumed["learning-rate"] == reference["learning-rate"]
    assert resumed["consumed-samples"] == reference["consumed-samples"]
    for key in ("lm loss", "grad-norm"):
        assert math.isclose(resumed[key], reference[key], rel_tol=rtol, abs_tol=0), (
            key, resumed[key], reference[key])
