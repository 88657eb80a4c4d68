"""End to end: train at one layout, resume at another, through train.py as a user runs it.

A (dp2, 2 processes) trains 8 iterations and saves at 4 and 8. B (tp2) resumes from A's
iteration 4 and saves at 6 and 8. C (tp1, 1 process) resumes from B's iteration 6.
The first resumed iteration of B (5) is compared with A's uninterrupted iteration 5, and C's (7)
with B's uninterrupted iteration 7: both start from exactly the same weights and optimizer state,
so they differ only by the order of floating-point reductions across the layouts.

Tolerance (fp32): relative 1e-5 for ``lm loss`` and ``grad-norm``. fp32 has eps 1.2e-7; the
loss and the squared-norm sums run over ~1e5 terms whose association changes with TP/DP (TP
splits the GEMM reductions, DP splits the batch mean), so rounding differences of
O(sqrt(n) * eps) ~ 1e-5 relative are the worst expected; a wrong weight, moment or data position
moves these figures by orders of magnitude more. Learning rate and consumed samples are exact.
"""

from __future__ import annotations

import math

import pytest

from recipes.metrics import read_metrics
from wandb_offline import history, run_files

RTOL = 1e-5
COMMON = ["train.train_iters=8", "optim.lr_warmup_iters=2", "logger=wandb"]


@pytest.fixture(scope="module")
def runs(train_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    a, b, c = root / "a_dp2", root / "b_tp2", root / "c_tp1"
    train_run(a, *COMMON, "parallelism=dp2", "checkpoint.save_interval=4")
    train_run(b, *COMMON, "parallelism=tp2", "checkpoint.save_interval=2",
              f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=4")
    out_c = train_run(c, *COMMON, "parallelism=tp1", "checkpoint.save_interval=2",
                      f"checkpoint.load={b}/checkpoints", "checkpoint.load_iteration=6")
    return {"a": a, "b": b, "c": c, "c_stdout": out_c.stdout}


def by_iteration(run_dir):
    rows, events = read_metrics(run_dir)
    return {r["iteration"]: r for r in rows}, events


def assert_same_step(resumed: dict, reference: dict):
    assert resumed["learning-rate"] == reference["learning-rate"]
    assert resumed["consumed-samples"] == reference["consumed-samples"]
    for key in ("lm loss", "grad-norm"):
        assert math.isclose(resumed[key], reference[key], rel_tol=RTOL, abs_tol=0), (
            key, resumed[key], reference[key])


def test_loss_falls_in_the_uninterrupted_run(runs):
    a, _ = by_iteration(runs["a"])
    assert sorted(a) == list(range(1, 9))
    assert a[8]["lm loss"] < a[1]["lm loss"] - 0.3


def test_dp2_to_tp2_continues_the_run(runs):
    a, _ = by_iteration(runs["a"])
    b, events = by_iteration(runs["b"])
    assert sorted(b) == [5, 6, 7, 8], "B must continue at iteration 5"
    resume = [e for e in events if e["event"] == "resume"]
    assert resume and resume[0]["iteration"] == 4
    assert resume[0]["from_layout"]["data_parallel_size"] == 2
    assert resume[0]["layout"]["tensor_model_parallel_size"] == 2
    assert b[5]["consumed-samples"] == a[4]["consumed-samples"] + 16
    assert_same_step(b[5], a[5])


def test_tp2_to_tp1_continues_the_run(runs):
    b, _ = by_iteration(runs["b"])
    c, _ = by_iteration(runs["c"])
    assert sorted(c) == [7, 8]
    assert_same_step(c[7], b[7])


def test_wandb_chart_continues_across_resume(runs):
    files = {k: run_files(runs[k]) for k in ("a", "b", "c")}
    assert all(len(f) == 1 for f in files.values()), files
    ids, steps = set(), []
    for key, first_step in (("a", 1), ("b", 5), ("c", 7)):
        run_id, rows = history(files[key][0])
        ids.add(run_id)
        got = [step for step, _ in rows]
        assert got == list(range(first_step, 9)), (key, got)
        for step, items in rows:
            assert math.isfinite(items["grad-norm"]) and items["grad-norm"] > 0, (key, step)
            assert "lm loss" in items
        steps.append(got)
    assert len(ids) == 1, f"one wandb run id across the resumes, got {ids}"
    # A -> B (resumed from 4) -> C (resumed from 6): the chart's steps increase at each hop.
    assert steps[0][3] < steps[1][0] and steps[1][1] < steps[2][0]


SENTINEL = -999.0


def _reload_and_resave(cfg_path, src_root, iteration, dst_root):
    """On every rank: build the model at the config's layout, fill it with a sentinel, load
    ``src_root``'s ``iteration``, check nothing kept the sentinel, save it to ``dst_root``."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from recipes import checkpoint, worker
    from recipes.validate import validate

    cfg = OmegaConf.load(cfg_path)
    layout = validate(cfg, torch.distributed.get_world_size())
    _, model, optimizer, scheduler = worker.setup(cfg, layout)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    record = checkpoint.layout_record(layout)
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

    # The recorded layouts differ by design (they say who wrote the file).
    writer = ("layout/", "gtp_layout/")
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
