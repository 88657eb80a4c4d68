"""End to end: train at one layout, resume at another: A through train.py as a user runs it, the
forks B and C as in-world jobs (the same code a torchrun rank runs).

A (dp2, 2 processes) trains towards 8 iterations saving every 4, crashes (an injected error) after
iteration 6's step, and is resumed into its own checkpoint dir: it continues its wandb run from
iteration 4 and saves 8. B (tp2) resumes from A's iteration 4 into its own dir (a fork) and saves
at every iteration from 5 (save_interval 1). C (tp1, 1 process) forks from B's iteration 5.
Every resumed iteration of B (5-8) is compared with A's, and C's (6-8) with B's: both start from exactly the same weights and optimizer state, so they differ only by
the order of floating-point reductions across the layouts. Validation runs every 2 iterations.

Tolerance (fp32): ``tolerance.fp32_rtol(steps)`` for ``lm loss``, ``grad-norm`` and ``lm loss
validation`` (tests/helpers/tolerance.py: 2 * steps * sqrt(n) * 2**-24, n the parameter count,
steps since both runs held the same bits); the loss and the squared-norm sums run over ~1e5
terms whose association changes with TP/DP (TP splits the GEMM reductions, DP splits the batch
mean); a wrong weight, moment or data position moves these figures by orders of magnitude more.
Learning rate and consumed samples are exact. The crashed run's iteration 5 against its own
resume's is ``==``: the same layout on the same machine, the same bits.
"""

from __future__ import annotations

import math
import re

import pytest

from ckpt.format.records import LAYOUT_KEY, SHARDING_RECORD_KEY
from recipes.metrics.logger import read_metrics
from resume_checks import assert_same_step, by_iteration
from tolerance import assert_fp32_close
from wandb_offline import config, history, run_files

COMMON = ["train.train_iters=8", "optim.lr_warmup_iters=2", "logger=wandb", "train.eval_interval=2"]
CRASH = {"GTP_RECIPES_FAULT": "raise:train:6:0"}


@pytest.fixture(scope="module")
def runs(train_run, train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    a, b, c = root / "a_dp2", root / "b_tp2", root / "c_tp1"
    crashed = train_run(a, *COMMON, "parallelism=dp2", "checkpoint.save_interval=4", rc=None,
                        env=CRASH)
    assert crashed.returncode != 0, crashed.stdout[-3000:]
    resumed = train_run(a, *COMMON, "parallelism=dp2", "checkpoint.save_interval=4",
                        f"checkpoint.load={a}/checkpoints")
    # The forks B and C are in-world jobs (tests/helpers/inworld.py): the crash and its resume
    # above are train.py's own behaviour, these two only continue a run at another layout.
    _, out_c = train_jobs([
        (b, [*COMMON, "parallelism=tp2", "checkpoint.save_interval=1",
             f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=4"]),
        (c, [*COMMON, "parallelism=tp1", "checkpoint.save_interval=2",
             f"checkpoint.load={b}/checkpoints", "checkpoint.load_iteration=5"]),
    ])
    return {"a": a, "b": b, "c": c, "a_stdout": resumed.stdout, "c_stdout": out_c.stdout}


def test_loss_falls_in_the_uninterrupted_run(runs):
    a, _ = by_iteration(runs["a"])
    assert sorted(a) == list(range(1, 9))
    assert a[8]["lm loss"] < a[1]["lm loss"] - 0.3


def test_crashed_run_continues_from_its_last_checkpoint(runs):
    rows, events = read_metrics(runs["a"])
    # Rows 1..5 of the crashed job, then 5..8 of the resumed one (5 again: logged after the save).
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    first, again = rows[4], rows[5]
    # same computation: one run dir, one command, iteration 5 again from iteration 4's save
    assert again["lm loss"] == first["lm loss"] and again["grad-norm"] == first["grad-norm"]
    resume = [e for e in events if e["event"] == "resume"]
    assert resume[0]["iteration"] == 4 and resume[0]["wandb_parent_run_id"] is None


def test_dp2_to_tp2_continues_the_run(runs):
    a, _ = by_iteration(runs["a"])
    b, events = by_iteration(runs["b"])
    assert sorted(b) == [5, 6, 7, 8], "B must continue at iteration 5"
    resume = [e for e in events if e["event"] == "resume"]
    assert resume and resume[0]["iteration"] == 4
    assert resume[0]["from_layout"]["data_parallel_size"] == 2
    assert resume[0]["layout"]["tensor_model_parallel_size"] == 2
    assert b[5]["consumed-samples"] == a[4]["consumed-samples"] + 16
    for it in (5, 6, 7, 8):  # every iteration after the resume (4): it - 4 steps of rounding
        assert_same_step(b[it], a[it], steps=it - 4)


def test_tp2_to_tp1_continues_the_run(runs):
    b, _ = by_iteration(runs["b"])
    c, _ = by_iteration(runs["c"])
    assert sorted(c) == [6, 7, 8], "C must continue at iteration 6"
    for it in (6, 7, 8):  # three after the resume (5): it - 5 steps of rounding
        assert_same_step(c[it], b[it], steps=it - 5)


def test_validation_every_interval_and_equal_after_resume(runs):
    """Validation at 2, 4, 6, 8; a resumed run (at another layout too) validates as the run it
    continues: A (dp2) vs B (tp2, from A's 4) at 6 and 8, B vs C (tp1, from B's 5) at 6 and 8."""
    a, b, c = (by_iteration(runs[k])[0] for k in "abc")
    for run, want in ((a, [2, 4, 6, 8]), (b, [6, 8]), (c, [6, 8])):
        assert sorted(i for i, r in run.items() if "lm loss validation" in r) == want
    for got, ref, it in ((b, a, 6), (b, a, 8), (c, b, 6), (c, b, 8)):
        v, w = got[it]["lm loss validation"], ref[it]["lm loss validation"]
        # after iteration it's update: it - 4 + 1 steps since b left a's bits at 4 (c, b's at 5: fewer)
        assert_fp32_close(v, w, it - 3, what=("validation", it))
        assert got[it]["lm loss validation ppl"] == pytest.approx(math.exp(v), rel=1e-12)
    assert a[8]["lm loss validation"] < a[2]["lm loss validation"]
    assert "validation loss at iteration 8 | lm loss value:" in runs["c_stdout"]


def test_progress_line_shows_timestamp_resume_and_remaining(runs):
    line = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +7/8 \(resumed from 5\) \| "
                      r"remaining: \d+:\d\d:\d\d \| ms/iter: [\d.]+ \|", re.M)
    assert line.search(runs["c_stdout"]), runs["c_stdout"][-3000:]


def test_the_run_closes_with_a_summary(runs):
    """A's resumed run: wall time, final and best validation loss, the checkpoint to resume from,
    the command that trains on and the offline wandb run to upload."""
    rows, _ = read_metrics(runs["a"])
    last = {k: v for r in rows[5:] for k, v in r.items()}  # the resumed job's rows 5..8
    best = min((r["lm loss validation"], r["iteration"]) for r in rows[5:]
               if "lm loss validation" in r)
    assert "> run complete" in runs["a_stdout"], runs["a_stdout"][-3000:]
    summary = runs["a_stdout"][runs["a_stdout"].index("> run complete"):]
    assert re.match(r"> run complete: iteration 8/8 in \d+:\d\d:\d\d \(wall time\)\n", summary)
    assert f">   final lm loss: {last['lm loss']:.6E}\n" in summary, summary
    assert (f">   lm loss validation: final {last['lm loss validation']:.6E} (iteration 8), "
            f"best {best[0]:.6E} (iteration {best[1]})\n") in summary, summary
    assert f">   resume from: {runs['a']}/checkpoints/iter_0000008\n" in summary, summary
    assert re.search(rf">   train on with: python \S+train.py hydra.run.dir={runs['a']} .* "
                     r"checkpoint.load=auto train.train_iters=16\n", summary), summary
    assert "train.train_iters=8" not in summary
    offline = run_files(runs["a"])[-1].parent  # the resumed job's offline run
    assert f">   wandb offline run: upload it with `wandb sync {offline}`" in summary, summary
    assert runs["a_stdout"].count("> run complete") == 1  # rank 0 only


def test_wandb_one_run_per_lineage_and_no_dropped_step(runs):
    """The crash and its resume write one run (two offline files, steps increasing across them,
    rows after the last save kept as new steps); B and C are forks: new ids whose config names
    the parent and its iteration, branching at the parent's step of that iteration."""
    files = {k: run_files(runs[k]) for k in ("a", "b", "c")}
    assert [len(files[k]) for k in "abc"] == [2, 1, 1], files
    (id_a1, rows_a1), (id_a2, rows_a2) = (history(f) for f in files["a"])
    assert id_a1 == id_a2
    steps = [s for s, _ in rows_a1 + rows_a2]
    assert steps == sorted(set(steps)), f"a wandb server drops steps that do not increase: {steps}"
    iterations = [r["iteration"] for _, r in rows_a1 + rows_a2]
    assert iterations == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    step_of = {r["iteration"]: s for s, r in rows_a1}
    lineage = {"a": id_a1}
    for key, parent, at in (("b", "a", 4), ("c", "b", 5)):
        run_id, rows = history(files[key][0])
        lineage[key] = run_id
        cfg = config(files[key][0])
        assert cfg["parent_run_id"] == lineage[parent] and cfg["parent_iteration"] == at, cfg
        branch = cfg["_wandb"]["branch_point"]
        assert branch["run_id"] == lineage[parent] and branch["step"] == step_of[at], branch
        assert rows[0][0] == step_of[at] + 1, (key, rows[0])
        assert [r["iteration"] for _, r in rows] == list(range(at + 1, 9))
        step_of = {r["iteration"]: s for s, r in rows}
        for _, items in rows:
            assert math.isfinite(items["grad-norm"]) and items["grad-norm"] > 0
    assert len(set(lineage.values())) == 3, lineage


SENTINEL = -999.0


def _reload_and_resave(cfg_path, src_root, iteration, dst_root):
    """On every rank: build the model at the config's layout, fill it with a sentinel, load
    ``src_root``'s ``iteration``, check nothing kept the sentinel, save it to ``dst_root``."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from ckpt import io as checkpoint
    from recipes.run import worker
    from recipes.config.validate import validate

    cfg = OmegaConf.load(cfg_path)
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    _, model, optimizer, scheduler = worker.setup(cfg, parallel_dims)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    record = checkpoint.layout_record(parallel_dims)
    common = checkpoint.load_checkpoint(src_root, model, optimizer, scheduler, record, iteration)
    for name, p in model.named_parameters():
        assert not (p == SENTINEL).any(), f"{name} kept the sentinel: the load skipped it"
    steps = {int(s["step"]) for s in optimizer.state_dict()["state"].values() if "step" in s} \
        if hasattr(optimizer, "state_dict") else set()
    checkpoint.save_checkpoint(dst_root, iteration, model, optimizer, scheduler,
                               common["train_state"], record)
    parallel_state.destroy_model_parallel()
    return sorted(steps)


def _compare_checkpoints(a, b):
    """Every tensor (model, Adam moments, fp32 params) and the optimizer step, bit for bit."""
    import torch
    from megatron.core import dist_checkpointing

    ta, tb = dist_checkpointing.load_plain_tensors(a), dist_checkpointing.load_plain_tensors(b)
    ca, cb = dist_checkpointing.load_common_state_dict(a), dist_checkpointing.load_common_state_dict(b)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}/")
            else:
                yield f"{prefix}{k}", v

    # The layout and sharding records differ by design (they say who wrote the file).
    writer = (f"{LAYOUT_KEY}/", f"{SHARDING_RECORD_KEY}/")
    fa = {k: v for k, v in flat(ta) if not k.startswith(writer)}
    fb = {k: v for k, v in flat(tb) if not k.startswith(writer)}
    problems = [] if fa.keys() == fb.keys() else [f"keys differ: {sorted(fa.keys() ^ fb.keys())[:5]}"]
    n_moments = sum("exp_avg" in k for k in fa)
    for k in sorted(fa.keys() & fb.keys()):
        if not isinstance(fa[k], torch.Tensor):
            if fa[k] != fb[k]:
                problems.append(f"{k}: {fa[k]!r} != {fb[k]!r}")
        elif not torch.equal(fa[k], fb[k]):
            problems.append(f"{k}: max abs diff {(fa[k].float() - fb[k].float()).abs().max().item()}")
    step_a, step_b = ca["optimizer"]["state"]["common_step"], cb["optimizer"]["state"]["common_step"]
    if not torch.equal(torch.as_tensor(step_a), torch.as_tensor(step_b)):
        problems.append(f"optimizer step {step_a} != {step_b}")
    return problems, len(fa), n_moments, float(torch.as_tensor(step_a))


@pytest.mark.parametrize("tp, world", [(2, 2), (1, 1)])
def test_weights_and_adam_state_restored_exactly(runs, tmp_path, tp, world):
    """Write at dp2 (run A), read at another layout, write again: every element identical."""
    from omegaconf import OmegaConf

    from multiproc import run_distributed

    cfg = OmegaConf.load(runs["a"] / "resolved_config.yaml")
    cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.nproc_per_node = tp, world
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(OmegaConf.to_yaml(cfg))
    src, dst = runs["a"] / "checkpoints", tmp_path / "resaved"
    run_distributed(_reload_and_resave, world, str(cfg_path), str(src), 4, str(dst), timeout=300)
    problems, n_tensors, n_moments, step = run_distributed(
        _compare_checkpoints, 1, str(src / "iter_0000004"), str(dst / "iter_0000004"))[0]
    # exp_avg and exp_avg_sq for each of the 17 (layer-stacked) parameter keys of the tiny model.
    assert n_moments == 2 * 17 and step == 4.0, (n_moments, step)
    assert not problems, problems[:10]
