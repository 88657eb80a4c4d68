"""End to end (both jobs in one 4-process world, run as train.py's workers run them,
tests/helpers/inworld.py): Muon on an MoE model trains the same with experts split over
expert-parallel ranks and expert GTP as with all experts on every rank.

``moe_tiny`` with ``optim=muon`` ("highest" Newton-Schulz precision, duplicated TP mode) at ep1
(dp4, 4 processes, the same global batch) is the reference; ep2 x expert GTP 2 at alignment 16 (4 processes: expert fc1
200 -> 224 rows, fc2 72 -> 96) gives its ``lm loss`` and ``grad-norm`` at iterations 1 and 2
within ``tolerance.fp32_rtol`` (tests/helpers/tolerance.py). Iteration 2's loss is the first Muon update's: without ``gtp.muon`` the
expert updates would be scaled by the padded shape and the expert optimizer's grad norm reduced
over a group that leaves out the expert-GTP ranks.

Saved at iteration 3 with the experts split (a Muon, an expert Muon and an Adam optimizer) and
resumed at ep1 (one Muon, one Adam), and saved at ep1 and resumed split: iterations 4, 5 and 6
continue the saving run within ``tolerance.fp32_rtol`` (another reduction order from there).

In bf16 (upstream Megatron-LM's own test found Muon's save over expert-GTP experts failing
there): ep2 x expert GTP 2 at alignment 16 saves at iteration 3; resumed at alignment 32 (other
padding rows, the same logical tensors), iterations 4, 5 and 6 agree with the uninterrupted
run within 2e-3 (bf16 weights).
"""

from __future__ import annotations

import pytest

from resume_checks import assert_same_step, by_iteration
from tolerance import MOE_TINY

pytestmark = pytest.mark.e2e

MOE_MUON = ("model=moe_tiny", "optim=muon", "checkpoint=none", "train.train_iters=2",
            "train.eval_iters=0", "optim.lr_warmup_iters=0", "optim.lr_decay_iters=6",
            "parallelism=tp1")


SPLIT = ("parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
         "gtp.pad_for_alignment=16")
SIX = ("train.train_iters=6", "checkpoint.save_interval=3")


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    ep1 = tmp_path_factory.mktemp("muon_moe_ep1")
    split = tmp_path_factory.mktemp("muon_moe_ep2_egtp2")
    joined, resplit = (tmp_path_factory.mktemp(n) for n in ("muon_moe_join", "muon_moe_split"))
    world = (*MOE_MUON, "parallelism.nproc_per_node=4")
    done = train_jobs([
        (ep1, [*world, *SIX]), (split, [*world, *SPLIT, *SIX]),
        # Each saved at iteration 3 and resumed where the other runs: the experts joined (one
        # Muon + Adam chain from a Muon + expert Muon + Adam one), then split again.
        (joined, [*world, "train.train_iters=6", "checkpoint.save=null",
                  f"checkpoint.load={split}/checkpoints", "checkpoint.load_iteration=3"]),
        (resplit, [*world, *SPLIT, "train.train_iters=6", "checkpoint.save=null",
                   f"checkpoint.load={ep1}/checkpoints", "checkpoint.load_iteration=3"])])
    root = tmp_path_factory.mktemp("muon_moe_bf16")
    bf16 = [*MOE_MUON[:2], "train.eval_iters=0", "optim.lr_warmup_iters=1", "parallelism=tp1",
            "precision=bf16", "train.train_iters=6", "parallelism.nproc_per_node=4",
            "parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2"]
    train_jobs([(root / "a16", [*bf16, "gtp.pad_for_alignment=16", "checkpoint.save_interval=3"]),
                (root / "a32", [*bf16, "gtp.pad_for_alignment=32", "checkpoint.save=null",
                                f"checkpoint.load={root / 'a16'}/checkpoints",
                                "checkpoint.load_iteration=3"])])
    return ep1, split, done[1].stdout, root, joined, resplit


def test_muon_on_moe_under_expert_gtp_resumes_in_bf16(runs):
    root = runs[3]
    reference, rows = by_iteration(root / "a16")[0], by_iteration(root / "a32")[0]
    assert sorted(reference) == [1, 2, 3, 4, 5, 6] and sorted(rows) == [4, 5, 6]
    for it in (4, 5, 6):
        assert rows[it]["learning-rate"] == reference[it]["learning-rate"]
        for key in ("lm loss", "grad-norm"):
            assert rows[it][key] == pytest.approx(reference[it][key], rel=2e-3), (key, it)


def test_muon_on_moe_trains_the_same_at_ep2_x_egtp2(runs):
    ep1, split, stdout = runs[:3]
    assert "experts ep2 x etp1 x egtp2" in stdout, stdout[-3000:]
    reference, rows = by_iteration(ep1)[0], by_iteration(split)[0]
    assert sorted(rows) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for it in (1, 2):  # the same initial weights: `it` steps of rounding apart
        assert_same_step(rows[it], reference[it], steps=it, terms=MOE_TINY)


@pytest.mark.parametrize("which", ["joined", "split"])
def test_muon_on_moe_resumes_where_the_experts_are_joined_or_split(runs, which):
    """Saved with the experts split (ep2 x expert GTP 2: megatron's Muon, expert Muon and Adam
    optimizers) and resumed at ep1 (one Muon and one Adam), and the other way: iterations 4,
    5 and 6 continue the saving run (1 to 3 steps of another reduction order apart)."""
    ep1, split, _, _, joined, resplit = runs
    source, resumed = (split, joined) if which == "joined" else (ep1, resplit)
    reference, rows = by_iteration(source)[0], by_iteration(resumed)[0]
    assert sorted(rows) == [4, 5, 6]
    for it in (4, 5, 6):
        assert_same_step(rows[it], reference[it], steps=it - 3, terms=MOE_TINY)
