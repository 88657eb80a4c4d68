"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py): a
Llama-style model resumed across layouts, and a resumed loss that does not depend on how the
vocabulary is padded.

Every run trains to iteration 5; the uninterrupted ones save at 2 and each resumed run's
iterations 3, 4 and 5 are compared with the uninterrupted run's: both start from the same
weights, Adam moments and data position, so ``lm loss`` and ``grad-norm`` differ only by the
order of floating-point reductions across layouts (``tolerance.fp32_rtol(it - 2)`` in fp32,
tests/helpers/tolerance.py); learning rate and consumed samples are exact.
"""

from __future__ import annotations

import math

import pytest

from resume_checks import assert_same_step, by_iteration
from tolerance import LLAMA_TINY

pytestmark = pytest.mark.e2e


RESUMED = (3, 4, 5)
VOCAB = ("vocab_a", "vocab_b", "vocab_c")
LLAMA = ("llama_a", "llama_tp1", "llama_tp2", "llama_g2a16")


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    """vocab_a: tp1 (1 process), make_vocab_size_divisible_by=3 (257 -> 258 rows), saved at 2;
    vocab_b resumes it at tp4 (264 rows), vocab_c at tp2 with make_vocab_size_divisible_by=128
    (384 rows). llama_a: the acceptance command, llama_tiny at tp2 x gtp2/a16 (4 processes),
    saved at 2; llama_tp1, llama_tp2 and llama_g2a16 resume it. (Loads into tp2 x gtp2/a16 are
    checked weight by weight in tests/test_checkpoint_layouts.py.) Ordered so that jobs of one
    world size run together: 1, 4, 2, then 1 process."""
    root = tmp_path_factory.mktemp("llama_vocab")
    d = {name: root / name for name in (*VOCAB, *LLAMA)}
    common = ["train.train_iters=5", "optim.lr_warmup_iters=1"]
    llama = [*common, "model=llama_tiny"]

    def load(src):
        return [f"checkpoint.load={d[src]}/checkpoints", "checkpoint.load_iteration=2",
                "checkpoint.save=null"]

    jobs = [
        ("vocab_a", [*common, "parallelism=tp1", "parallelism.nproc_per_node=1",
                     "model.make_vocab_size_divisible_by=3", "checkpoint.save_interval=2"]),
        ("llama_a", [*llama, "parallelism=tp2dp2", "gtp=tp2_align16",
                     "checkpoint.save_interval=2"]),
        ("vocab_b", [*common, *load("vocab_a"), "parallelism=tp4", "parallelism.nproc_per_node=4",
                     "model.make_vocab_size_divisible_by=3"]),
        ("vocab_c", [*common, *load("vocab_a"), "parallelism=tp2",
                     "model.make_vocab_size_divisible_by=128"]),
        ("llama_tp2", [*llama, *load("llama_a"), "parallelism=tp2"]),
        ("llama_g2a16", [*llama, *load("llama_a"), "parallelism=tp1",
                         "parallelism.nproc_per_node=2", "gtp=tp2_align16"]),
        ("llama_tp1", [*llama, *load("llama_a"), "parallelism=tp1",
                       "parallelism.nproc_per_node=1"]),
    ]
    done = train_jobs([(d[name], overrides) for name, overrides in jobs])
    out = {name: by_iteration(d[name])[0] for name in d}
    out["a_checkpoints"] = d["vocab_a"] / "checkpoints"
    out["llama_a_stdout"] = done[1].stdout
    out["vocab_c_stdout"] = done[3].stdout
    return out


@pytest.fixture(scope="module")
def vocab_runs(runs):
    return {"a": runs["vocab_a"], "b": runs["vocab_b"], "c": runs["vocab_c"],
            "a_checkpoints": runs["a_checkpoints"], "c_stdout": runs["vocab_c_stdout"]}


@pytest.fixture(scope="module")
def llama_runs(runs):
    return {"a": runs["llama_a"], "tp1": runs["llama_tp1"], "tp2": runs["llama_tp2"],
            "g2a16": runs["llama_g2a16"], "a_stdout": runs["llama_a_stdout"]}


def test_resumed_loss_does_not_depend_on_vocabulary_padding(vocab_runs):
    a = vocab_runs["a"]
    assert sorted(a) == [1, 2, *RESUMED]
    for name in ("b", "c"):
        assert sorted(vocab_runs[name]) == list(RESUMED), name
        for it in RESUMED:  # same bits at the resume (2): it - 2 steps of rounding apart
            assert_same_step(vocab_runs[name][it], a[it], steps=it - 2)


def test_the_resume_ran_with_the_vocabulary_padding_it_gave(vocab_runs):
    """vocab_c gives model.make_vocab_size_divisible_by=128: the resume keeps it (the model
    fields a command line does not give come from the checkpoint) and says so."""
    import re

    table = vocab_runs["c_stdout"]
    assert re.search(r"model\.make_vocab_size_divisible_by\s+3\s+128\s", table), table[-3000:]


def test_another_tokenizer_is_refused_before_launch(vocab_runs):
    """The checkpoint of the 257-token byte tokenizer, resumed with a 300-token vocabulary:
    pre-launch validation (what train.py runs before starting workers) refuses it."""
    from compose import make_cfg

    from ckpt.io import CheckpointError
    from recipes.config.validate import validate

    cfg = make_cfg("data=indexed", "data.paths=[unused]", "data.vocab_size=300",
                   "data.eod_id=299", f"checkpoint.load={vocab_runs['a_checkpoints']}")
    with pytest.raises(CheckpointError, match=r"vocabulary of 257 tokens.*has 300"):
        validate(cfg, 2)


def test_llama_tiny_trains_at_tp2_gtp2(llama_runs):
    a = llama_runs["a"]
    assert sorted(a) == [1, 2, *RESUMED]
    assert all(math.isfinite(r["lm loss"]) for r in a.values())
    assert a[5]["lm loss"] < a[1]["lm loss"]
    assert "tp2 x gtp2(pad 16) x dp1 (world 4)" in llama_runs["a_stdout"]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "g2a16"])
def test_llama_resumes_from_tp2_gtp2(llama_runs, layout):
    assert sorted(llama_runs[layout]) == list(RESUMED)
    for it in RESUMED:  # same bits at the resume (2): it - 2 steps of rounding apart
        assert_same_step(llama_runs[layout][it], llama_runs["a"][it], steps=it - 2,
                         terms=LLAMA_TINY)
