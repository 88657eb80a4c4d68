"""End to end (the jobs run as train.py's workers run them, tests/helpers/inworld.py; the
refusal through train.py): save under GTP, resume under other layouts (ckpt/format/logical_format.py).

A trains the tiny GPT at ``gtp=tp2_align16`` (tp1 x gtp2 x dp1, 2 processes) for 6 iterations and
saves at 3 and 6 (the uninterrupted run). From A's iteration 3:

* B resumes at ``gtp=off parallelism=tp1`` (1 process);
* C at ``gtp=tp4_align32`` (tp1 x gtp4, 4 processes: an all-padding GTP rank);
* D at ``gtp=tp2_align1 parallelism=tp2dp2`` (tp2 x gtp2, 4 processes);
* E at ``gtp=tp2_align16 gtp.pad_for_alignment=128 parallelism=tp2dp2`` (tp2 x gtp2, pads of
  148-156 rows per TP-local weight: the padded loader at TP > 1 that stock 0.19.2 reads shifted);
* F is E with ``gtp.checkpoint_layout=stock`` (megatron 0.19.2's own GTP checkpoint path),
  which would read those rows shifted: it is refused before launch.

Resumed runs train iterations 4, 5 and 6. Iteration 4 (the first after the resume) checks the
weights (loss and grad norm depend on nothing else), iterations 5 and 6 also the Adam moments,
step and lr schedule. Each must equal A's: ``learning-rate`` and ``consumed-samples`` exactly, ``lm loss``
and ``grad-norm`` within ``tolerance.fp32_rtol(it - 3)`` (fp32; the layouts differ only in
reduction order, tests/helpers/tolerance.py derives the bound).
"""

from __future__ import annotations


import pytest

from resume_checks import by_iteration
from tolerance import assert_fp32_close

pytestmark = pytest.mark.e2e

# lr_decay_iters pinned so that the schedule does not depend on each run's train_iters.
COMMON = ["optim.lr_warmup_iters=2", "optim.lr_decay_iters=6", "logger=none"]
RESUMED = {
    "b_off_tp1": ["gtp=off", "parallelism=tp1"],
    "c_g4a32": ["gtp=tp4_align32", "parallelism.nproc_per_node=4"],
    "d_tp2_g2a1": ["gtp=tp2_align1", "parallelism=tp2dp2"],
    "e_tp2_g2a128": ["gtp=tp2_align16", "gtp.pad_for_alignment=128", "parallelism=tp2dp2"],
}
STOCK = ["gtp=tp2_align16", "gtp.pad_for_alignment=128", "parallelism=tp2dp2",
         "gtp.checkpoint_layout=stock"]


@pytest.fixture(scope="module")
def runs(train_run, train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gtp_resume")
    a = root / "a_g2a16"
    out = {"a": a, **{name: root / name for name in RESUMED}}
    load = [f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=3"]
    # By world size: a (2 processes), then the 4-process resumes, then tp1 (1 process).
    order = sorted(RESUMED, key=lambda name: name == "b_off_tp1")
    train_jobs([(a, [*COMMON, "gtp=tp2_align16", "train.train_iters=6",
                     "checkpoint.save_interval=3"]),
                *[(out[name], [*COMMON, *RESUMED[name], "train.train_iters=6",
                               "checkpoint.save_interval=100", *load]) for name in order]])
    out["f_tp2_g2a128_stock"] = train_run(
        root / "f_tp2_g2a128_stock", *COMMON, *STOCK, "train.train_iters=5", *load, rc=2).stdout
    return out


def rel(x, y):
    return abs(x - y) / abs(y)


@pytest.mark.parametrize("name", ["b_off_tp1", "c_g4a32", "d_tp2_g2a1", "e_tp2_g2a128"])
def test_resumed_run_continues_the_uninterrupted_one(runs, name):
    a, _ = by_iteration(runs["a"])
    got, events = by_iteration(runs[name])
    assert sorted(a) == [1, 2, 3, 4, 5, 6]
    assert sorted(got) == [4, 5, 6], f"{name} must continue at iteration 4"
    resume = [e for e in events if e["event"] == "resume"]
    assert resume and resume[0]["iteration"] == 3
    assert resume[0]["from_layout"]["gtp_remat_size"] == 2
    assert resume[0]["from_layout"]["pad_for_alignment"] == 16
    for it in (4, 5, 6):
        assert got[it]["learning-rate"] == a[it]["learning-rate"], (name, it)
        assert got[it]["consumed-samples"] == a[it]["consumed-samples"], (name, it)
        for key in ("lm loss", "grad-norm"):  # same bits at the resume (3): it - 3 steps apart
            assert_fp32_close(got[it][key], a[it][key], it - 3, what=(name, it, key))
    print(f"\n{name}: iteration 4 lm loss rel diff {rel(got[4]['lm loss'], a[4]['lm loss']):.1e}, "
          f"grad-norm rel diff {rel(got[4]['grad-norm'], a[4]['grad-norm']):.1e}; "
          f"iteration 5: {rel(got[5]['lm loss'], a[5]['lm loss']):.1e}, "
          f"{rel(got[5]['grad-norm'], a[5]['grad-norm']):.1e}")


def test_big_pad_layout_really_padded(runs):
    _, events = by_iteration(runs["e_tp2_g2a128"])
    layout = next(e["layout"] for e in events if e["event"] == "resume")
    assert (layout["tensor_model_parallel_size"], layout["gtp_remat_size"],
            layout["pad_for_alignment"]) == (2, 2, 128)


def test_stock_layout_refuses_a_checkpoint_of_another_layout(runs):
    """megatron 0.19.2's GTP checkpoint path would read TP rank 1's GTP shards shifted by the pad
    (tests/test_checkpoint_layouts.py shows the rows) and train on: refused before launch, naming
    the layout that loads it."""
    out = runs["f_tp2_g2a128_stock"]
    assert "error: checkpoint.format=stock cannot load" in out, out[-2000:]
    assert "use checkpoint.format=logical" in out
    assert not (runs["a"].parent / "f_tp2_g2a128_stock" / "metrics.jsonl").exists()


def test_pad_for_alignment_is_stored_once(runs):
    """The GTP record owns pad_for_alignment; the layout record does not repeat it, and
    ckpt.format.records.saved_layout gives it back with the rest of the layout."""
    from megatron.core import dist_checkpointing

    from ckpt.format.records import SHARDING_RECORD_KEY, saved_layout

    common = dist_checkpointing.load_common_state_dict(
        str(runs["a"] / "checkpoints" / "iter_0000003"))
    assert "pad_for_alignment" not in common["layout"]
    assert common[SHARDING_RECORD_KEY]["pad_for_alignment"] == 16
    layout = saved_layout(common)
    assert (layout["gtp_remat_size"], layout["pad_for_alignment"]) == (2, 16)
