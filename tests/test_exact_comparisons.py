"""Guard for the comparison rule of docs/testing.md: a training figure of two runs is compared
with ``==`` only when both runs are the same computation on the same machine, and everything
else within the derived fp32 bound (tests/helpers/tolerance.py). Issue 53: a distributed-
optimizer run and a plain-optimizer resume were compared with ``==``; equal on the machine that
wrote the test, not on the next CPU.

Two rules, checked on the test sources without running them:

- No test compares one metric of two rows with ``==`` itself (``got[it]["lm loss"] ==
  want[it]["lm loss"]``, also through a loop variable or a constant naming the metric): it calls
  ``resume_checks.assert_bit_for_bit``, which first checks from both runs' resolved configs that
  they compute the same steps (``assert_same_computation``: layout, GTP, precision, optimizer,
  batch split, model), or compares within the bound (``assert_same_step``,
  ``tolerance.assert_fp32_close``, ``tolerance.assert_zeros_close``).
- ``learning-rate`` and ``consumed-samples`` (Python arithmetic, the same on every CPU) and the
  iteration may be compared with ``==`` anywhere.
- A pair without two run dirs (rows of one run, figures of one in-process world) that is the
  same computation says why in a comment on the comparison's line or the line above:
  ``# same computation: <why>``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The one module allowed to compare metrics with ==, after its same-computation check.
HELPER = TESTS / "helpers" / "resume_checks.py"
# Figures of a training step, kernels' arithmetic: their rounding differs between computations.
METRICS = {"lm loss", "grad-norm", "lm loss validation", "lm loss validation ppl", "mtp_1 loss",
           "num-zeros", "loss", "grad_norm", "load-balancing loss", "tokens-per-expert"}


def _metric_names(tree: ast.AST) -> set[str]:
    """Names bound to a metric: module constants (``VALID = "lm loss validation"``) and loop
    variables over a literal holding one (``for key in ("lm loss", "grad-norm")``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if node.value.value in METRICS:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if (isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set))):
            if any(isinstance(e, ast.Constant) and e.value in METRICS for e in node.iter.elts):
                names.add(node.target.id)
    return names


def _is_metric(index: ast.AST, names: set[str]) -> bool:
    return ((isinstance(index, ast.Constant) and index.value in METRICS)
            or (isinstance(index, ast.Name) and index.id in names))


# The comment that declares a pair the same computation, saying why.
SAME = "# same computation:"


def exact_metric_comparisons(source: str) -> list[int]:
    """Line numbers of ``==`` / ``!=`` between two subscripts that index the same metric, in
    ``source`` (a test module's text), except where :data:`SAME` is on its lines or the line
    above."""
    lines = source.splitlines()
    tree = ast.parse(source)
    names = _metric_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, sides, sides[1:]):
            if (isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(a, ast.Subscript)
                    and isinstance(b, ast.Subscript) and _is_metric(a.slice, names)
                    and ast.dump(a.slice) == ast.dump(b.slice)
                    and not any(SAME in line
                                for line in lines[max(node.lineno - 2, 0):node.end_lineno])):
                found.append(node.lineno)
    return sorted(set(found))


def test_no_test_compares_two_runs_metrics_with_eq_itself():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == HELPER:
            continue
        for line in exact_metric_comparisons(path.read_text()):
            found.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert not found, (
        "a metric of two runs compared with ==; use resume_checks.assert_bit_for_bit (same "
        "computation: it checks) or assert_same_step / tolerance.assert_fp32_close: "
        + ", ".join(found))


@pytest.mark.parametrize("source", [
    'assert got[it]["lm loss"] == want[it]["lm loss"]',
    'for key in ("lm loss", "learning-rate"):\n    assert got[3][key] == want[3][key]',
    'VALID = "lm loss validation"\nassert got[5][VALID] == want[5][VALID]',
    'assert again["grad-norm"] == first["grad-norm"]',
    'assert got[1]["num-zeros"] != ref[1]["num-zeros"]',
])
def test_the_rule_finds_each_form_of_an_exact_metric_comparison(source):
    assert exact_metric_comparisons(source) != []


@pytest.mark.parametrize("source", [
    'assert got[3]["learning-rate"] == want[3]["learning-rate"]',
    'assert got[3]["consumed-samples"] == want[3]["consumed-samples"]',
    'assert got[3]["lm loss"] < want[1]["lm loss"]',
    'assert_fp32_close(got[3]["lm loss"], want[3]["lm loss"], 1)',
    'for key in ("shape", "dtype"):\n    assert a[key] == b[key]',
    'assert a["loss"] == b["loss"]  # same computation: one world, the same steps',
])
def test_the_rule_leaves_python_arithmetic_and_tolerant_comparisons(source):
    assert exact_metric_comparisons(source) == []


def test_two_runs_of_different_computations_are_refused_as_bit_for_bit(tmp_path):
    """``assert_same_computation`` names each field that makes two runs different computations,
    and ignores where they write, log and load."""
    import yaml

    from resume_checks import assert_bit_for_bit, assert_same_computation

    base = {"model": {"name": "tiny", "hidden_size": 72}, "output_dir": "a",
            "optim": {"name": "adam", "use_distributed_optimizer": True, "lr_decay_iters": 5},
            "data": {"cache_dir": "x", "micro_batch_size": 2},
            "checkpoint": {"load": None, "async_save": False}, "logger": {"wandb": False},
            "train": {"train_iters": 5}}
    dirs = {}
    for name, change in (("want", {}), ("resume", {"output_dir": "b", "train": {"train_iters": 9},
                                                   "checkpoint": {"load": "a/ck",
                                                                  "async_save": True},
                                                   "data": {"cache_dir": "y",
                                                            "micro_batch_size": 2}}),
                         ("plain", {"optim": {"name": "adam", "use_distributed_optimizer": False,
                                    "lr_decay_iters": 5}}),
                         ("mb1", {"data": {"cache_dir": "x", "micro_batch_size": 1}})):
        cfg = {**base, **change}
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "resolved_config.yaml").write_text(yaml.safe_dump(cfg))
    assert_same_computation(dirs["resume"], dirs["want"])
    rows = {3: {"lm loss": 1.0, "grad-norm": 2.0, "learning-rate": 0.1, "consumed-samples": 4}}
    assert_bit_for_bit(rows, rows, (3,), got_dir=dirs["resume"], want_dir=dirs["want"])
    for name, field in (("plain", "optim.use_distributed_optimizer True -> False"),
                        ("mb1", "data.micro_batch_size 2 -> 1")):
        with pytest.raises(AssertionError, match="not the same computation") as err:
            assert_bit_for_bit(rows, rows, (3,), got_dir=dirs[name], want_dir=dirs["want"])
        assert field in str(err.value)
    # The same config run with another CPU thread count per rank (a submitit task against a
    # train.py worker): the start and resume events say so.
    for name, threads in (("want", 1), ("resume", 2)):
        event = {"event": "start" if name == "want" else "resume", "iteration": 0,
                 "num_threads": threads}
        (dirs[name] / "metrics.jsonl").write_text(json.dumps(event) + "\n")
    with pytest.raises(AssertionError, match=r"num_threads \[1\] -> \[2\]"):
        assert_same_computation(dirs["resume"], dirs["want"])
