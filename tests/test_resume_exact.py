"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py): a resume
stays on the uninterrupted trajectory at every iteration after it, not only the first (issue:
the shared Adam ``step`` after a distributed-optimizer load drifted from the second resumed
iteration on).

Four uninterrupted runs of the tiny GPT train 6 iterations and save at 3 (lr_decay_iters pinned
so every run has the same schedule):

* ``plain``: dp2, fp32, plain Adam (the golden-curve config, ``tests/helpers/golden_curve.py``);
* ``distopt``: dp2, fp32, distributed optimizer;
* ``bf16_g2_distopt``: dp2 x gtp2/a16 (4 processes), bf16, distributed optimizer;
* ``bf16_pp2``: pp2, bf16, plain Adam.

Each is resumed from its iteration 3 at its own layout and must give iterations 4, 5 and 6
**bit for bit** (``==`` on ``lm loss``, ``grad-norm``, ``learning-rate``: the same machine runs
the same kernels in the same order on the same bits). Across layouts and optimizer kinds (fp32)
iterations 4-6 agree within ``tolerance.fp32_rtol(it - 3)`` (tests/helpers/tolerance.py:
reduction order only): plain -> distributed optimizer, distributed optimizer -> plain tp2, and
bf16 pp2 -> fp32 dp2 with either optimizer, which agree only if both take every weight from the
checkpoint's fp32 main params (the distributed optimizer's are sharded over dp2).

Precision changes are also checked on the tensors, against the saved ones read by torch's own
DCP reader (no project code): with ``optim.lr=0`` one resumed iteration changes no weight, so
the checkpoint it writes must hold, bf16 -> fp32, weights equal to the bf16 run's fp32 main
params, and fp32 -> bf16, fp32 main params equal to the fp32 run's weights.

Adam's ``adam_eps`` changed on resume is the checkpoint's (said in the table, recorded in the
resolved config, losses equal an unchanged resume) unless ``optim.override_opt_param_scheduler``.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from golden_curve import GOLDEN, OVERRIDES as GOLDEN_OVERRIDES, curve
from resume_checks import EXACT_KEYS, assert_bit_for_bit, by_iteration
from tolerance import assert_fp32_close, assert_zeros_close, fp32_rtol

pytestmark = pytest.mark.e2e

COMMON = ["optim.lr_warmup_iters=1", "optim.lr_decay_iters=6", "logger=none",
          "train.eval_interval=0"]
DISTOPT = "optim.use_distributed_optimizer=true"
REFS = {
    "plain": [],
    "distopt": [DISTOPT],
    "bf16_g2_distopt": ["precision=bf16", "gtp=tp2_align16", "parallelism.nproc_per_node=4",
                        DISTOPT],
    "bf16_pp2": ["precision=bf16", "parallelism=pp2"],
}
# name: (the run it loads at 3, overrides)
CROSS = {
    "plain_to_distopt": ("plain", [DISTOPT]),
    "distopt_to_tp2_plain": ("distopt", ["parallelism=tp2"]),
    "bf16_to_fp32_dp2_plain": ("bf16_pp2", []),
    "bf16_to_fp32_dp2_distopt": ("bf16_pp2", [DISTOPT]),
    "eps_kept": ("plain", ["optim.adam_eps=0.1"]),
    "eps_override": ("plain", ["optim.adam_eps=0.1", "optim.override_opt_param_scheduler=true"]),
}
FROZEN = ["optim.lr=0", "optim.min_lr=0", "optim.override_opt_param_scheduler=true",
          "train.train_iters=4", "checkpoint.save_interval=4"]
# name: (the run it loads at 3, overrides): one iteration at lr 0, saved at 4.
PRECISION = {
    "bf16_to_fp32_frozen": ("bf16_pp2", []),
    "fp32_to_bf16_distopt_frozen": ("plain", ["precision=bf16", DISTOPT]),
    "fp32_to_bf16_plain_frozen": ("plain", ["precision=bf16"]),
}
ITERS = (4, 5, 6)


def _load(runs, src):
    return [f"checkpoint.load={runs[src]}/checkpoints", "checkpoint.load_iteration=3"]


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_exact")
    out = {}
    jobs = []
    # The 4-process reference first (one world), then every 2-process job (another).
    for name in sorted(REFS, key=lambda n: "nproc_per_node=4" not in " ".join(REFS[n])):
        overrides = REFS[name]
        out[name], out[f"{name}_again"] = root / name, root / f"{name}_again"
        base = GOLDEN_OVERRIDES if name == "plain" else [
            *COMMON, "train.train_iters=6", "checkpoint.save_interval=3"]
        jobs.append((out[name], [*base, *overrides]))
        jobs.append((out[f"{name}_again"], [*COMMON, *overrides, "train.train_iters=6",
                                            "checkpoint.save_interval=3", *_load(out, name)]))
    for name, (src, overrides) in CROSS.items():
        out[name] = root / name
        jobs.append((out[name], [*COMMON, "train.train_iters=6", "checkpoint.save_interval=100",
                                 *overrides, *_load(out, src)]))
    for name, (src, overrides) in PRECISION.items():
        out[name] = root / name
        jobs.append((out[name], [*COMMON, *overrides, *FROZEN, *_load(out, src)]))
    done = dict(zip([str(d) for d, _ in jobs], train_jobs(jobs)))
    stdout = {name: done[str(out[name])].stdout for name in (*CROSS, *PRECISION)}
    return out, stdout


def _rows(run_dir) -> dict:
    return by_iteration(run_dir)[0]


@pytest.mark.parametrize("name", list(REFS))
def test_same_layout_resume_is_bit_exact_for_three_iterations(runs, name):
    dirs, _ = runs
    ref, again = _rows(dirs[name]), _rows(dirs[f"{name}_again"])
    assert sorted(again) == list(ITERS), sorted(again)
    assert_bit_for_bit(again, ref, ITERS, (*EXACT_KEYS, "num-zeros"),
                       got_dir=dirs[f"{name}_again"], want_dir=dirs[name])


@pytest.mark.parametrize("name", ["plain_to_distopt", "distopt_to_tp2_plain"])
def test_resume_into_and_out_of_the_distributed_optimizer_follows_the_run(runs, name):
    dirs, _ = runs
    src = CROSS[name][0]
    ref, got = _rows(dirs[src]), _rows(dirs[name])
    assert sorted(got) == list(ITERS)
    for it in ITERS:
        assert got[it]["learning-rate"] == ref[it]["learning-rate"]
        for key in ("lm loss", "grad-norm"):  # another optimizer or layout from 3: it - 3 steps
            assert_fp32_close(got[it][key], ref[it][key], it - 3, what=(name, it, key))


def test_bf16_to_fp32_resumes_agree_across_layouts_and_optimizers(runs):
    dirs, stdout = runs
    a, b = _rows(dirs["bf16_to_fp32_dp2_plain"]), _rows(dirs["bf16_to_fp32_dp2_distopt"])
    for it in ITERS:
        for key in ("lm loss", "grad-norm"):  # two optimizers from the same bits at 3
            assert_fp32_close(a[it][key], b[it][key], it - 3, what=(it, key))
    assert "precision.params_dtype" in stdout["bf16_to_fp32_dp2_plain"]
    assert "weights taken from the checkpoint's fp32 main params" in stdout["bf16_to_fp32_dp2_plain"]


def _torch_dcp_tensors(path) -> dict:
    """Every tensor of a checkpoint dir, read by torch's own DCP reader into one dict."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        dcp_to_torch_save(str(path), f.name)
        return {k: v for k, v in torch.load(f.name, weights_only=False).items()
                if isinstance(v, torch.Tensor)}


def _weights(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if not k.startswith(("optimizer.", "rng"))
            and v.is_floating_point()}


@pytest.mark.parametrize("name, source_prefix, target_prefix", [
    ("bf16_to_fp32_frozen", "optimizer.state.fp32_param.", ""),
    ("fp32_to_bf16_distopt_frozen", "", "optimizer.state.param."),
    ("fp32_to_bf16_plain_frozen", "", "optimizer.state.fp32_param."),
])
def test_a_precision_change_takes_the_fp32_copy_exactly(runs, name, source_prefix, target_prefix):
    dirs, stdout = runs
    src = dirs[PRECISION[name][0]] / "checkpoints" / "iter_0000003"
    before, after = _torch_dcp_tensors(src), _torch_dcp_tensors(
        dirs[name] / "checkpoints" / "iter_0000004")
    names = sorted(_weights(before if source_prefix == "" else after))
    assert len(names) == 17, names  # the tiny GPT's layer-stacked parameter keys
    for key in names:
        want, got = before[source_prefix + key], after[target_prefix + key]
        assert want.dtype == got.dtype == torch.float32, (key, want.dtype, got.dtype)
        assert torch.equal(got, want), (key, (got - want).abs().max().item())
        if target_prefix:  # fp32 -> bf16: the weights are the fp32 ones rounded to nearest
            assert torch.equal(after[key], want.to(torch.bfloat16)), key
    assert "precision.params_dtype" in stdout[name]


def test_adam_eps_change_keeps_the_checkpoints_value_unless_overridden(runs):
    dirs, stdout = runs
    again, kept, override = (_rows(dirs[n]) for n in ("plain_again", "eps_kept", "eps_override"))
    # The kept eps: the same computation as the plain resume (its resolved config says 1e-8).
    assert_bit_for_bit(kept, again, ITERS, ("lm loss", "grad-norm"),
                       got_dir=dirs["eps_kept"], want_dir=dirs["plain_again"])
    # The overriding one moves the loss by far more than rounding could (2 steps after 3).
    rel = abs(override[5]["lm loss"] / again[5]["lm loss"] - 1)
    assert rel > 100 * fp32_rtol(2), rel
    recorded = OmegaConf.load(dirs["eps_kept"] / "resolved_config.yaml")
    assert recorded.optim.adam_eps == 1e-8
    assert OmegaConf.load(dirs["eps_override"] / "resolved_config.yaml").optim.adam_eps == 0.1
    line = next(l for l in stdout["eps_kept"].splitlines() if "optim.adam_eps" in l)
    assert "checkpoint's 1e-08 kept" in line, line


def test_the_recorded_adam_step_counts_the_applied_steps(runs):
    """The checkpoint after a resume into the distributed optimizer records step 6 at iteration
    6 (not one increment per parameter)."""
    from megatron.core import dist_checkpointing

    dirs, _ = runs
    for name in ("distopt_again", "bf16_g2_distopt_again"):
        common = dist_checkpointing.load_common_state_dict(
            str(dirs[name] / "checkpoints" / "iter_0000006"))
        steps = {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]}
        assert steps == {6}, (name, steps)


def test_golden_loss_curve(runs):
    """The fixed config's curve is the file in the repo (``make golden`` regenerates it), which
    was written on some other CPU: ``learning-rate`` exactly (Python floats, no kernel), ``lm
    loss`` and ``grad-norm`` within ``fp32_rtol(iteration)`` (other kernels round differently:
    an AMD EPYC's iteration-5 grad-norm is one fp32 ulp off), num-zeros within ZEROS_RTOL."""
    from recipes.metrics.logger import read_metrics

    dirs, _ = runs
    rows, _ = read_metrics(dirs["plain"])
    got, want = curve(rows), json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for it, row in want.items():
        assert got[it]["learning-rate"] == row["learning-rate"], it
        assert_zeros_close(got[it]["num-zeros"], row["num-zeros"], what=(it,))
        for key in ("lm loss", "grad-norm"):  # `it` steps of rounding from the same init
            assert_fp32_close(got[it][key], row[key], int(it), what=(it, key))
