"""End to end (tests/helpers/inworld.py): ``train.calculate_per_token_loss=true`` (Megatron-LM's
--calculate-per-token-loss) makes the loss and its gradients the mean over the global batch's
loss tokens, whatever the micro-batch size, the data-parallel size and the GTP degree.

The reference is megatron's default loss with the whole global batch in one micro-batch on one
rank (``ref``): the mean of one micro-batch's mean is the mean over the global batch's tokens,
computed without the per-token path. LLaVA on ``data=shapes`` is where it matters (captions
differ in length, so micro-batches hold different token counts):

* ``mb1``: per-token loss, four micro-batches of one sample, one rank: ``ref``'s figures at
  every iteration; without per-token loss (``mb1_mean``) they differ by more than round-off;
* ``g2``: per-token loss at g2/a16 (the two GTP peers read different samples: the gtp_remat
  reduce-scatter must sum, not average);
* ``resumed``: ``mb1``'s save at iteration 2 resumed at dp2 with two samples a micro-batch,
  iterations 3..5 against ``mb1``'s.

On text data every token counts, so both losses are the same mean: an MoE model at g2/a16 and at
expert GTP 2 with per-token loss against the default loss at tp1 (the expert gradient scale,
``gtp.expert_grads.scale_expert_gradients``, must leave the summed expert gradients alone), and
a Llama model with one MTP layer at pp2 against tp1 (``mtp_1 loss`` too).
"""

from __future__ import annotations

import pytest

from resume_checks import assert_same_step, by_iteration
from tolerance import LLAMA_TINY, MOE_TINY, assert_fp32_close, fp32_rtol

pytestmark = pytest.mark.e2e

LLAVA = ["model=llava_tiny", "data=shapes", "data.global_batch_size=4", "train.train_iters=5",
         "train.eval_iters=0", "checkpoint.save_interval=2"]
PER_TOKEN = "train.calculate_per_token_loss=true"
ONE_RANK = ["parallelism=tp1", "parallelism.nproc_per_node=1"]
LLAVA_PARAMETERS = 248_640  # llava_tiny's (tests/test_llava_config.py works it out by hand)
MOE = ["model=moe_tiny", "parallelism=tp1", "parallelism.nproc_per_node=2", "checkpoint=none",
       "train.train_iters=3", "train.eval_iters=0"]
G2 = ["gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16"]
EGTP2 = ["gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"]
# Multi-token prediction on text data: the MTP loss's own token count, and the count
# broadcast from the last pipeline stage (finalize_model_grads).
MTP = ["model=llama_tiny", "model.mtp_num_layers=1", "checkpoint=none", "train.train_iters=3",
       "train.eval_iters=0"]
RESUMED_AT = 2


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("per_token")
    # Only mb1's save (iteration 2) is read. mb1_mean is compared at iteration 1 only, g2 over
    # 3 iterations (the schedule of ref's 5).
    jobs = {
        "ref": [*LLAVA, *ONE_RANK, "data.micro_batch_size=4", "checkpoint=none"],
        "mb1": [*LLAVA, *ONE_RANK, "data.micro_batch_size=1", PER_TOKEN],
        "mb1_mean": [*LLAVA, *ONE_RANK, "data.micro_batch_size=1", "train.train_iters=1",
                     "optim.lr_warmup_iters=0", "checkpoint=none"],
        "g2": [*LLAVA, "parallelism=tp1", "parallelism.nproc_per_node=2", "gtp=tp2_align16",
               "data.micro_batch_size=1", PER_TOKEN, "train.train_iters=3",
               "optim.lr_decay_iters=5", "checkpoint=none"],
        "resumed": [*LLAVA, "parallelism=dp2", "data.micro_batch_size=2", PER_TOKEN,
                    f"checkpoint.load={root / 'mb1'}/checkpoints",
                    f"checkpoint.load_iteration={RESUMED_AT}", "checkpoint.save=null"],
        "mtp": [*MTP, *ONE_RANK],
        "mtp_pp2": [*MTP, "parallelism=pp2", PER_TOKEN],
        "moe": [*MOE],
        "moe_g2": [*MOE, *G2, PER_TOKEN],
        "moe_egtp2": [*MOE, *EGTP2, PER_TOKEN],
    }
    done = train_jobs([(root / name, overrides) for name, overrides in jobs.items()])
    out = {name: by_iteration(root / name)[0] for name in jobs}
    out["consoles"] = dict(zip(jobs, (job.stdout for job in done)))
    return out


def test_per_token_loss_is_independent_of_the_micro_batch_size(runs):
    ref, mb1 = runs["ref"], runs["mb1"]
    assert sorted(mb1) == sorted(ref) == [1, 2, 3, 4, 5]
    for it in ref:  # same initial weights: it steps of rounding apart
        assert_same_step(mb1[it], ref[it], it, terms=LLAVA_PARAMETERS)


def test_without_it_the_loss_depends_on_the_micro_batch_size(runs):
    """The mean of four one-sample means is another figure, and the test above would see it:
    the grad-norm moves by 4e-4 relative, 7 times the round-off bound (the loss by 1e-5, within the
    round-off bound at this size)."""
    ref, mean = runs["ref"], runs["mb1_mean"]
    rtol = fp32_rtol(1, LLAVA_PARAMETERS)
    assert abs(mean[1]["grad-norm"] - ref[1]["grad-norm"]) > 3 * rtol * ref[1]["grad-norm"]


def test_per_token_loss_at_g2_sums_over_the_gtp_peers(runs):
    ref, g2 = runs["ref"], runs["g2"]
    assert "> GTP:" in runs["consoles"]["g2"]
    assert sorted(g2) == [1, 2, 3]
    for it in g2:
        assert_same_step(g2[it], ref[it], it, terms=LLAVA_PARAMETERS)


def test_a_per_token_run_resumes_at_another_micro_batch_size_and_dp(runs):
    want, got = runs["mb1"], runs["resumed"]
    assert sorted(got) == [3, 4, 5]
    for it in got:
        assert_same_step(got[it], want[it], it - RESUMED_AT, terms=LLAVA_PARAMETERS)


@pytest.mark.parametrize("name", ["moe_g2", "moe_egtp2"])
def test_moe_per_token_loss_under_gtp_and_expert_gtp(runs, name):
    ref, got = runs["moe"], runs[name]
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for it in ref:
        assert_same_step(got[it], ref[it], it, terms=MOE_TINY)


def test_mtp_per_token_loss_at_pp2(runs):
    ref, got = runs["mtp"], runs["mtp_pp2"]
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for it in ref:
        assert_same_step(got[it], ref[it], it, terms=LLAMA_TINY)
        assert_fp32_close(got[it]["mtp_1 loss"], ref[it]["mtp_1 loss"], it, LLAMA_TINY)
