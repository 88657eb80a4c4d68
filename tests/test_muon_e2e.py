"""End to end through train.py with ``optim=muon`` (megatron's TensorParallelMuon for 2-D
weights, Adam for the rest; "highest" Newton-Schulz precision, duplicated TP mode): the same
training at every layout, and a resume at another layout that stays on the uninterrupted run.

* ``tp1`` (dp2, 6 iterations) is the reference;
* ``tp2``, ``g2a16`` (tp1 x gtp2, pad 16) and ``tp2_g2a32`` (tp2 x gtp2, pad 32, 4 processes)
  train 2 iterations, ``tp2_g2a16`` (4 processes) 3 and saves there (``train.exit_interval``);
  every one gives the reference's ``lm loss`` and ``grad-norm`` at iterations 1 and 2 (and 3)
  within ``tolerance.fp32_rtol(it)`` (reduction order only, tests/helpers/tolerance.py). Iteration 1 has the full lr
  (no warmup), so iteration 2's loss is the first Muon update's. megatron-core 0.19.2 without
  ``gtp.muon`` scales GTP weights' updates by the padded shape: ``g2a16``'s iteration-2
  grad-norm then reads 2.5360 against 2.5248 (4e-3, far outside the tolerance).
* ``resumed`` loads ``tp2_g2a16``'s iteration 3 at tp1 (dp2): iterations 4, 5 and 6 equal the
  reference's within ``fp32_rtol(it)`` (both left tp1's bits at 1); 5 and 6 depend on the loaded Muon momentum buffers.
* ``optim=adam`` from that checkpoint is refused before launch (exit 2), naming both optimizers
  and the ways on.

lr_decay_iters is pinned at 6 so every run has the reference's schedule.
"""

from __future__ import annotations

import pytest
import torch

from resume_checks import assert_same_step, by_iteration

pytestmark = pytest.mark.e2e

COMMON = ["optim=muon", "optim.lr_warmup_iters=0", "optim.lr_decay_iters=6",
          "train.eval_interval=0"]
LAYOUTS = {
    "tp2": (["parallelism=tp2", "train.train_iters=2", "checkpoint.save=null"], (1, 2)),
    "g2a16": (["gtp=tp2_align16", "train.train_iters=2", "checkpoint.save=null"], (1, 2)),
    "tp2_g2a32": (["parallelism=tp2dp2", "gtp=tp2_align32", "train.train_iters=2",
                   "checkpoint.save=null"], (1, 2)),
    "tp2_g2a16": (["parallelism=tp2dp2", "gtp=tp2_align16", "train.train_iters=6",
                   "checkpoint.save_interval=3", "train.exit_interval=3"], (1, 2, 3)),
}
# The tiny model's 2-D weights that megatron gives to Muon (checkpoint keys, layers stacked).
MUON_WEIGHTS = {"embedding.position_embeddings.weight",
                "decoder.layers.self_attention.linear_qkv.weight",
                "decoder.layers.self_attention.linear_proj.weight",
                "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight"}


@pytest.fixture(scope="module")
def runs(train_run, train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    out = {name: root / name for name in ("tp1", *LAYOUTS, "resumed")}
    load = [f"checkpoint.load={out['tp2_g2a16']}/checkpoints", "checkpoint.load_iteration=3"]
    # One 4-process world, then one 2-process world (the resume loads the 4-process save).
    train_jobs([*[(out[name], [*COMMON, *LAYOUTS[name][0]]) for name in ("tp2_g2a32", "tp2_g2a16")],
                (out["tp1"], [*COMMON, "parallelism=dp2", "train.train_iters=6",
                              "checkpoint.save=null"]),
                *[(out[name], [*COMMON, *LAYOUTS[name][0]]) for name in ("tp2", "g2a16")],
                (out["resumed"], [*COMMON, "parallelism=dp2", "train.train_iters=6",
                                  "checkpoint.save=null", *load])])
    refused = train_run(root / "into_adam", "optim=adam", "optim.lr_decay_iters=6",
                        "train.train_iters=6", *load, rc=2).stdout
    return out, refused


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_trains_the_same_at_every_layout(runs, name):
    reference = by_iteration(runs[0]["tp1"])[0]
    rows = by_iteration(runs[0][name])[0]
    iterations = LAYOUTS[name][1]
    assert sorted(rows) == list(iterations), name
    for it in iterations:  # both from the same initial weights: `it` steps of rounding apart
        assert_same_step(rows[it], reference[it], steps=it)


def test_resume_at_another_layout_continues_the_uninterrupted_run(runs):
    reference = by_iteration(runs[0]["tp1"])[0]
    rows, events = by_iteration(runs[0]["resumed"])
    assert sorted(rows) == [4, 5, 6]
    for it in (4, 5, 6):  # the loaded run left tp1's bits at iteration 1, not at the resume
        assert_same_step(rows[it], reference[it], steps=it)
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["iteration"] == 3
    assert (resume["from_layout"]["tensor_model_parallel_size"],
            resume["from_layout"]["gtp_remat_size"], resume["from_layout"]["pad_for_alignment"],
            resume["layout"]["tensor_model_parallel_size"],
            resume["layout"]["gtp_remat_size"]) == (2, 2, 16, 1, 1)


def test_the_checkpoint_holds_muon_momentum_in_the_logical_layout(runs):
    """Every 2-D weight but the word embeddings and output layer has a momentum buffer, saved at
    its weight's logical shape (layers stacked, unsharded, no GTP padding: linear_qkv's 3 x 72
    rows, not tp2 x g2/a16's padded 2 x 128); Adam's moments for the rest."""
    import torch.distributed.checkpoint as dcp

    path = runs[0]["tp2_g2a16"] / "checkpoints" / "iter_0000003"
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {k: tuple(v.size) for k, v in meta.items()
               if not k.startswith(("optimizer", "chained", "rng", "common")) and hasattr(v, "size")}
    momentum = {k.split("momentum_buffer.", 1)[1]: tuple(v.size) for k, v in meta.items()
                if ".optimizer.state.momentum_buffer." in k}
    assert set(momentum) == MUON_WEIGHTS
    assert momentum == {k: weights[k] for k in MUON_WEIGHTS}
    assert momentum["decoder.layers.self_attention.linear_qkv.weight"] == (2, 216, 72)
    adam = {k.split("exp_avg.", 1)[1] for k in meta if ".optimizer.state.exp_avg." in k}
    assert adam == set(weights) - MUON_WEIGHTS


def test_resume_into_adam_is_refused_before_launch(runs):
    refused = runs[1]
    assert ("error: " in refused and "was written by optim.optimizer=muon and this run is "
            "optim.optimizer=adam" in refused), refused[-2000:]
    assert "resume with optim=muon" in refused and "checkpoint.pretrained=" in refused
    assert "> layout tp1" not in refused  # no worker started


def test_optimizer_names_of_checkpoints_and_optimizers(runs):
    from ckpt import io as checkpoint
    from ckpt.adapt import optim_kinds

    _, common = checkpoint.load_common(runs[0]["tp2_g2a16"] / "checkpoints", 3)
    assert optim_kinds.saved_optimizer_name(common["optimizer"]) == "muon"
    adam_common = {"param_groups": [{"betas": (0.9, 0.95), "eps": 1e-8, "lr": 0.0}],
                   "state": {"common_step": torch.tensor(3.0)}}
    assert optim_kinds.saved_optimizer_name(adam_common) == "adam"
    assert optim_kinds.saved_optimizer_name({"optimizer": adam_common}) == "adam"
