"""End to end, each job run as train.py's workers run it (tests/helpers/inworld.py): pipeline
parallelism and the distributed optimizer resume at other layouts.

A chain of runs of the tiny SwiGLU GPT. Run i resumes from run i-1's checkpoint of iteration i,
trains to iteration i + 4 and saves the iteration the next run loads (i + 1; a save every
i + 1 iterations, none at the end), so each link compares the three
iterations after the resume (i+1..i+3) with the previous run, which trained them without
interruption:

    pp2 x gtp2/a16 (4 proc) -> tp2, GTP off (2) -> dp2 + distributed optimizer (2)
      -> plain tp2 (2) -> tp2 x pp2 (4) -> tp1 x dp2 (2)

So: pp2 -> pp1 (GTP inside each stage -> GTP off), plain -> distributed optimizer and back,
pp1 -> pp2, tp2 x pp2 -> tp1 x dp2. ``learning-rate`` and ``consumed-samples`` are exact,
``lm loss`` and ``grad-norm`` within ``tolerance.fp32_rtol(it - link)`` (layouts differ only in
reduction order; tests/helpers/tolerance.py).

With tied embedding/output weights (the tiny GPT with 4 layers; the tied weight lives on both
pipeline stages): pp2 -> tp1 and pp2 x vpp2 (the interleaved schedule, stage 0 holding layers
0 and 2) -> tp1, each 4 iterations resumed from 1, and one-iteration runs at tp1 and at dp2
with the distributed optimizer. The iteration-1 ``lm loss``, ``grad-norm`` and ``num-zeros``
of tp1, dp2 + distributed optimizer and pp2 x vpp2 equal the pp2 run's within the derived
bounds (each logical element counted once, the tied weight once; ``num-zeros`` within
``tolerance.ZEROS_RTOL``: a gradient may cancel to 0.0 under one rounding only).
"""

from __future__ import annotations


import pytest

from recipes.metrics.logger import read_metrics
from tolerance import TINY_SWIGLU, TINY_TIED_4_LAYERS, assert_fp32_close, assert_zeros_close

pytestmark = pytest.mark.e2e

COMMON = ["optim.lr_warmup_iters=2", "optim.lr_decay_iters=10", "logger=none",
          "checkpoint.save_at_end=false"]
# Only the iteration a later job loads is needed on disk: a save every `k` iterations, where
# `k` is that iteration (none for a job nothing loads).
NO_SAVE = "checkpoint.save_interval=0"
SWIGLU = ["model=tiny_swiglu"]
TIED = ["model=tiny", "model.num_layers=4", "model.share_embeddings_and_output_weights=true"]
VPP2 = ["parallelism=pp2", "parallelism.virtual_pipeline_model_parallel_size=2"]
DISTOPT = "optim.use_distributed_optimizer=true"
CHAIN = [
    ("pp2g2a16", ["parallelism=pp2", "gtp=tp2_align16", "parallelism.nproc_per_node=4"]),
    ("tp2_off", ["parallelism=tp2", "gtp=off"]),
    ("dp2_distopt", ["parallelism=dp2", DISTOPT]),
    ("tp2_plain", ["parallelism=tp2"]),
    ("tp2pp2", ["parallelism=tp2pp2"]),
    ("tp1dp2", ["parallelism=dp2"]),
]
FIRST_ITERATION = {"tied_tp1_it1": ["parallelism=tp1"],
                   "tied_dp2_distopt_it1": ["parallelism=dp2", DISTOPT]}


@pytest.fixture(scope="module")
def chain(train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_resume")
    dirs = {name: root / name for name, _ in CHAIN}
    jobs, prev = [], None
    for i, (name, overrides) in enumerate(CHAIN):
        load = [] if prev is None else [f"checkpoint.load={prev}/checkpoints",
                                        f"checkpoint.load_iteration={i}"]
        loaded = i + 1 if i + 1 < len(CHAIN) else 0  # the next job loads iteration i + 1
        jobs.append((dirs[name], [*COMMON, *SWIGLU, *overrides, f"train.train_iters={i + 4}",
                                  f"checkpoint.save_interval={loaded}", *load]))
        prev = dirs[name]
    dirs.update({name: root / name for name in ("tied_pp2", "tied_pp2vpp2", "tied_tp1",
                                                "tied_vpp_tp1", *FIRST_ITERATION)})
    # Grouped by world size (one world per group): 2 processes, then 1.
    loaded = "checkpoint.save_interval=1"  # iteration 1
    jobs += [(dirs["tied_pp2"], [*COMMON, *TIED, "parallelism=pp2", "train.train_iters=4",
                                 loaded]),
             (dirs["tied_pp2vpp2"], [*COMMON, *TIED, *VPP2, "train.train_iters=4", loaded]),
             (dirs["tied_dp2_distopt_it1"], [*COMMON, *TIED, *FIRST_ITERATION["tied_dp2_distopt_it1"],
                                             "train.train_iters=1", NO_SAVE]),
             (dirs["tied_tp1"], [*COMMON, *TIED, "parallelism=tp1", "train.train_iters=4",
                                 NO_SAVE,
                                 f"checkpoint.load={dirs['tied_pp2']}/checkpoints",
                                 "checkpoint.load_iteration=1"]),
             (dirs["tied_vpp_tp1"], [*COMMON, *TIED, "parallelism=tp1", "train.train_iters=4",
                                     NO_SAVE,
                                     f"checkpoint.load={dirs['tied_pp2vpp2']}/checkpoints",
                                     "checkpoint.load_iteration=1"]),
             (dirs["tied_tp1_it1"], [*COMMON, *TIED, *FIRST_ITERATION["tied_tp1_it1"],
                                     "train.train_iters=1", NO_SAVE])]
    train_jobs(jobs)
    return dirs


def _rows(run_dir):
    rows, events = read_metrics(run_dir)
    return {r["iteration"]: r for r in rows}, events


LINKS = [(CHAIN[i - 1][0], CHAIN[i][0], i) for i in range(1, len(CHAIN))]
LINKS.append(("tied_pp2", "tied_tp1", 1))
LINKS.append(("tied_pp2vpp2", "tied_vpp_tp1", 1))


@pytest.mark.parametrize("before, after, link", LINKS, ids=[f"{b}->{a}" for b, a, _ in LINKS])
def test_three_resumed_iterations_continue_the_run_they_loaded(chain, before, after, link):
    prev, _ = _rows(chain[before])
    got, events = _rows(chain[after])
    assert min(got) == link + 1, (after, sorted(got))  # resumed from iteration `link`
    resume = [e for e in events if e["event"] == "resume"]
    assert resume and resume[0]["iteration"] == link
    for it in range(link + 1, link + 4):  # three iterations after the resume
        assert got[it]["learning-rate"] == prev[it]["learning-rate"], (after, it)
        assert got[it]["consumed-samples"] == prev[it]["consumed-samples"], (after, it)
        terms = TINY_TIED_4_LAYERS if before.startswith("tied") else TINY_SWIGLU
        for key in ("lm loss", "grad-norm"):  # same bits at `link`: it - link steps apart
            assert_fp32_close(got[it][key], prev[it][key], it - link, terms,
                              what=(f"{before} -> {after}", it, key))


def test_resume_records_pipeline_and_optimizer_layouts(chain):
    _, events = _rows(chain["tp2_plain"])
    (resume,) = [e for e in events if e["event"] == "resume"]
    src, dst = resume["from_layout"], resume["layout"]
    assert src["use_distributed_optimizer"]
    assert src["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    assert not dst["use_distributed_optimizer"] and dst["distrib_optim_sharding_type"] is None
    _, events = _rows(chain["tp1dp2"])
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["from_layout"]["pipeline_model_parallel_size"] == 2
    assert resume["layout"]["pipeline_model_parallel_size"] == 1
    _, events = _rows(chain["tied_vpp_tp1"])
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["from_layout"]["virtual_pipeline_model_parallel_size"] == 2
    assert resume["layout"]["virtual_pipeline_model_parallel_size"] is None


def test_iteration_one_grad_norm_and_num_zeros_equal_across_pp_vpp_and_distributed_optimizer(chain):
    ref, _ = _rows(chain["tied_pp2"])
    for name in (*FIRST_ITERATION, "tied_pp2vpp2"):
        got, _ = _rows(chain[name])
        # Other layouts and optimizer kinds: a gradient may cancel to 0.0 under one rounding only.
        assert_zeros_close(got[1]["num-zeros"], ref[1]["num-zeros"], what=(name,))
        for key in ("grad-norm", "lm loss"):  # one step from the same initial weights
            assert_fp32_close(got[1][key], ref[1][key], 1, TINY_TIED_4_LAYERS, what=(name, key))
