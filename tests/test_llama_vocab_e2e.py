"""End to end through train.py: a Llama-style model resumed across layouts, and a resumed loss
that does not depend on how the vocabulary is padded.

Each resumed run's first iteration is compared with the uninterrupted run's same iteration:
both start from the same weights, Adam moments and data position, so ``lm loss`` and
``grad-norm`` differ only by the order of floating-point reductions across layouts (relative
1e-5 in fp32, as tests/test_resume.py explains); learning rate and consumed samples are exact.
"""

from __future__ import annotations

import math

import pytest

from resume_checks import assert_same_step, by_iteration

pytestmark = pytest.mark.e2e


# --------------------------------------------------------------------------------------------
# The loss never depends on vocabulary padding.
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab_runs(train_run, tmp_path_factory):
    """A: tp1, make_vocab_size_divisible_by=3 (257 -> 258 rows), 3 iterations, saved at 2.
    B: resumed at tp4 (264 rows). C: resumed at tp2 with make_vocab_size_divisible_by=128
    (384 rows)."""
    root = tmp_path_factory.mktemp("vocab")
    common = ["train.train_iters=3", "optim.lr_warmup_iters=1"]
    a, b, c = root / "a", root / "b", root / "c"
    train_run(a, *common, "parallelism=tp1", "parallelism.nproc_per_node=1",
              "model.make_vocab_size_divisible_by=3", "checkpoint.save_interval=2")
    resume = [f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=2",
              "checkpoint.save=null"]
    train_run(b, *common, *resume, "parallelism=tp4", "parallelism.nproc_per_node=4",
              "model.make_vocab_size_divisible_by=3")
    train_run(c, *common, *resume, "parallelism=tp2", "model.make_vocab_size_divisible_by=128")
    out = {k: by_iteration(v)[0] for k, v in (("a", a), ("b", b), ("c", c))}
    out["a_checkpoints"] = a / "checkpoints"
    return out


def test_resumed_loss_does_not_depend_on_vocabulary_padding(vocab_runs):
    a = vocab_runs["a"]
    assert sorted(a) == [1, 2, 3]
    for name in ("b", "c"):
        assert sorted(vocab_runs[name]) == [3], name
        assert_same_step(vocab_runs[name][3], a[3])


def test_another_tokenizer_is_refused_before_launch(vocab_runs):
    """The checkpoint of the 257-token byte tokenizer, resumed with a 300-token vocabulary:
    pre-launch validation (what train.py runs before starting workers) refuses it."""
    from compose import make_cfg

    from recipes.checkpoint import CheckpointError
    from recipes.validate import validate

    cfg = make_cfg("data=indexed", "data.paths=[unused]", "data.vocab_size=300",
                   "data.eod_id=299", f"checkpoint.load={vocab_runs['a_checkpoints']}")
    with pytest.raises(CheckpointError, match=r"vocabulary of 257 tokens.*has 300"):
        validate(cfg, 2)


# --------------------------------------------------------------------------------------------
# llama_tiny: tp2 x gtp2/a16 resumed at tp1, tp2 and gtp2/a16.
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_runs(train_run, tmp_path_factory):
    """A: the acceptance command, tp2 x gtp2/a16 (4 processes), 3 iterations, saved at 2.
    From A's iteration 2: tp1, tp2 and gtp2/a16 each run iteration 3. (Loads into
    tp2 x gtp2/a16 are checked weight by weight in tests/test_checkpoint_layouts.py.)"""
    root = tmp_path_factory.mktemp("llama")
    common = ["model=llama_tiny", "optim.lr_warmup_iters=1"]
    runs = {k: root / k for k in ("a", "tp1", "tp2", "g2a16")}
    proc = train_run(runs["a"], *common, "parallelism=tp2dp2", "gtp=tp2_align16",
                     "train.train_iters=3", "checkpoint.save_interval=2")
    from_a = [f"checkpoint.load={runs['a']}/checkpoints", "checkpoint.load_iteration=2",
              "train.train_iters=3", "checkpoint.save=null"]
    train_run(runs["tp1"], *common, *from_a, "parallelism=tp1", "parallelism.nproc_per_node=1")
    train_run(runs["tp2"], *common, *from_a, "parallelism=tp2")
    train_run(runs["g2a16"], *common, *from_a, "parallelism=tp1", "parallelism.nproc_per_node=2",
              "gtp=tp2_align16")
    out = {k: by_iteration(v)[0] for k, v in runs.items()}
    out["a_stdout"] = proc.stdout
    return out


def test_llama_tiny_trains_at_tp2_gtp2(llama_runs):
    a = llama_runs["a"]
    assert sorted(a) == [1, 2, 3]
    assert all(math.isfinite(r["lm loss"]) for r in a.values())
    assert a[3]["lm loss"] < a[1]["lm loss"]
    assert "tp2 x gtp2(pad 16) x dp1 (world 4)" in llama_runs["a_stdout"]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "g2a16"])
def test_llama_resumes_from_tp2_gtp2(llama_runs, layout):
    assert sorted(llama_runs[layout]) == [3]
    assert_same_step(llama_runs[layout][3], llama_runs["a"][3])
