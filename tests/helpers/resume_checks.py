"""What the end-to-end resume tests compare: a run's metrics by iteration, and one resumed
iteration against the uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

from recipes.metrics.logger import read_metrics
from tolerance import TINY, assert_fp32_close

# What a same-computation pair compares bit for bit (Python arithmetic besides the step's own).
EXACT_KEYS = ("lm loss", "grad-norm", "learning-rate", "consumed-samples")


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


# Config fields that do not change what a training step computes: where things are written and
# read, logging, the checkpoint policy (async or not, retention, the load request itself), the
# run's length and exit conditions (the schedule is compared exactly as `learning-rate`), and
# group option names (their values are compared field by field).
NOT_COMPUTATION = ("output_dir", "data.cache_dir", "checkpoint.", "logger.", "train.train_iters",
                   "train.dry_run", "train.exit_", "train.gpu_memory_gib", "train.log_interval")


def computation_fields(run_dir) -> dict:
    """The fields of ``run_dir``'s ``resolved_config.yaml`` that decide what its training steps
    compute, flattened to ``{"group.field": value}``: everything but :data:`NOT_COMPUTATION` and
    the option names (``*.name``)."""
    import yaml

    from recipes.config.schema import RESOLVED_CONFIG

    cfg = yaml.safe_load((Path(run_dir) / RESOLVED_CONFIG).read_text())
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif not name.endswith(".name") and not name.startswith(NOT_COMPUTATION):
                flat[name] = value

    walk(cfg, "")
    # megatron decays over train_iters when lr_decay_iters is unset; a resume records the value.
    if flat.get("optim.lr_decay_iters") is None:
        flat["optim.lr_decay_iters"] = cfg.get("train", {}).get("train_iters")
    return flat


def _events(run_dir) -> list:
    """The run's events; none where it wrote no ``metrics.jsonl``."""
    try:
        return read_metrics(run_dir)[1]
    except FileNotFoundError:
        return []


def assert_same_computation(got_dir, want_dir) -> None:
    """Raise unless the runs in ``got_dir`` and ``want_dir`` compute the same training steps: the
    same model, layout, GTP, precision, optimizer, data and batch split (:func:`computation_fields`).
    Only such a pair, run on one machine, may be compared with ``==``; any other pair differs by
    fp32 rounding on some CPU (issue 53: equal on one machine, not on the next) and is compared
    with :func:`assert_same_step` within ``tolerance.fp32_rtol``."""
    got, want = computation_fields(got_dir), computation_fields(want_dir)
    # The CPU threads per rank too: another count sums in another order (a submitit task's
    # 2 threads against a launcher worker's 1 changed grad-norm's last digits).
    threads = {str(d): sorted({e["num_threads"] for e in _events(d) if "num_threads" in e})
               for d in (want_dir, got_dir)}
    if len({t for ts in threads.values() for t in ts}) > 1:
        got["num_threads"], want["num_threads"] = threads[str(got_dir)], threads[str(want_dir)]
    differ = {k: (want.get(k), got.get(k)) for k in sorted(set(got) | set(want))
              if got.get(k) != want.get(k)}
    assert not differ, (
        "not the same computation, so not comparable with ==: "
        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in differ.items())
        + "; compare within the derived bound (resume_checks.assert_same_step)")


def assert_bit_for_bit(got: dict, want: dict, iterations, keys=EXACT_KEYS, *, got_dir,
                       want_dir) -> None:
    """``got[it][key] == want[it][key]`` for every iteration and key, after
    :func:`assert_same_computation` showed both runs compute the same steps: a resume at the same
    layout against its uninterrupted run. ``got``/``want``: ``{iteration: metrics row}``."""
    assert_same_computation(got_dir, want_dir)
    for it in iterations:
        for key in keys:
            assert got[it][key] == want[it][key], (it, key, got[it][key], want[it][key])
