"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py):
``model=moe_tiny`` (4 SwiGLU experts, top-2, alltoall dispatcher, aux
loss 0.01) on 2 CPU processes at five layouts, 2 iterations each:

* ``ep1``: tp1 x dp2, every rank holds all 4 experts;
* ``ep2``: experts split over 2 ranks (2 each), tokens exchanged by megatron's alltoall;
* ``etp2``: each expert's linears split over 2 ranks (expert tensor parallelism at tp1);
* ``tp2+sp``: tensor and sequence parallelism (experts split by etp = tp = 2);
* ``egtp2``: expert GTP of degree 2 at alignment 16 (expert fc1 200 -> 224 rows, fc2 72 -> 96).

All read the same global batch from the same initial weights (CPU initialization slices one
full draw; experts draw per (layer, global expert), ``recipes.families.moe.model.init_experts``), so
iteration 1's ``lm loss``, ``grad-norm``, ``num-zeros`` and ``load_balancing_loss`` agree to fp32
reduction-order noise (``tolerance.fp32_rtol(1)``, tests/helpers/tolerance.py). ``grad-norm`` at ``ep2``/``etp2``/``egtp2`` equal to
``ep1``'s means each expert element is counted once. So do ``logger.grad_norm_detail``'s
per-part norms (the ``experts`` group among them), whose squares add up to ``grad-norm``, and
the per-layer tokens-per-expert ratios: integer counts over the same global batch, equal
unless a token whose 2nd and 3rd router logits nearly tie flips expert under another rounding
(each flip moves a ratio by 1/512: 1024 tokens x top-2 over 4 experts), so within two flips.
"""

from __future__ import annotations

import math
import re

import pytest

from recipes.metrics.logger import read_metrics
from tolerance import MOE_TINY, assert_fp32_close, assert_zeros_close

pytestmark = pytest.mark.e2e

MOE = ("model=moe_tiny", "checkpoint=none", "train.train_iters=2", "train.eval_iters=0",
       "parallelism=tp1", "parallelism.nproc_per_node=2", "logger.grad_norm_detail=true")
PARTS = ("embedding", "output", "norms", "attention", "experts", "mlp")
LAYOUTS = {
    "ep1": (),
    "ep2": ("parallelism.expert_model_parallel_size=2",),
    "etp2": ("parallelism.expert_tensor_parallel_size=2",),
    "tp2+sp": ("parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true"),
    "egtp2": ("gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
}
DESCRIBED = {
    "ep1": "tp1 x dp2 (world 2)",
    "ep2": "tp1 x dp2 (world 2); experts ep2 x etp1 x edp1",
    "etp2": "tp1 x dp2 (world 2); experts ep1 x etp2 x edp1",
    "tp2+sp": "tp2+sp x dp1 (world 2)",
    "egtp2": "tp1 x dp2 (world 2); experts ep1 x etp1 x egtp2 x edp1",
}


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    dirs = {name: tmp_path_factory.mktemp(f"moe_{name.replace('+', '_')}") for name in LAYOUTS}
    done = train_jobs([(dirs[name], [*MOE, *overrides]) for name, overrides in LAYOUTS.items()])
    return {name: (read_metrics(dirs[name])[0], job.stdout) for name, job in zip(LAYOUTS, done)}


def test_each_layout_ran_as_asked(runs):
    for name, (rows, stdout) in runs.items():
        assert f"> layout: {DESCRIBED[name]}" in stdout, (name, stdout[-3000:])
        assert [r["iteration"] for r in rows] == [1, 2], name
        for r in rows:
            assert all(math.isfinite(r[k]) for k in ("lm loss", "grad-norm", "load_balancing_loss"))
        # The load-balancing loss is on the console line too, not only in metrics.jsonl.
        assert re.search(r"iteration +2/2 \|.* \| lm loss: \S+ \| load_balancing_loss: "
                         r"\d\.\d{4}E[+-]\d\d \|", stdout), (name, stdout[-3000:])


def test_iteration_one_is_the_same_at_every_layout(runs):
    ref = runs["ep1"][0][0]
    # megatron's aux loss of a balanced top-2 router over 4 experts is about 1.
    assert 0.9 < ref["load_balancing_loss"] < 1.2, ref
    for name, (rows, _) in runs.items():
        first = rows[0]
        for key in ("lm loss", "grad-norm", "load_balancing_loss"):  # one step from one init
            assert_fp32_close(first[key], ref[key], 1, MOE_TINY, what=(name, key))
        assert first["learning-rate"] == ref["learning-rate"]
        # Each logical element once: expert-GTP padding rows (gtp.grad_stats) and expert
        # replicas are not counted (a gradient cancelling to 0.0 under one reduction order moves
        # it by one now and then, as tests/test_gtp_e2e.py notes).
        assert_zeros_close(first["num-zeros"], ref["num-zeros"], what=(name,))


def test_grad_norm_detail_has_an_experts_group_counted_once(runs):
    ref = runs["ep1"][0][0]
    assert ref["grad-norm/experts"] > 0.01 * ref["grad-norm"], ref  # present, not empty
    for name, (rows, _) in runs.items():
        for r in rows:
            # The parts partition the parameters: their squares add up to megatron's grad-norm.
            total = sum(r[f"grad-norm/{p}"] ** 2 for p in PARTS) ** 0.5
            # the same squares summed in another order: one reduction's rounding
            assert_fp32_close(total, r["grad-norm"], 1, MOE_TINY, what=(name, "parts"))
            assert sum(r[f"grad-norm/layer-{i}"] ** 2 for i in range(2)) < r["grad-norm"] ** 2
        for key in [f"grad-norm/{p}" for p in PARTS] + ["grad-norm/layer-0", "grad-norm/layer-1"]:
            assert_fp32_close(rows[0][key], ref[key], 1, MOE_TINY, what=(name, key))


def test_tokens_per_expert_ratios_are_the_same_at_every_layout(runs):
    from recipes.metrics.experts import metric_names

    keys = [k for layer in range(2) for k in metric_names(layer)]
    ref = runs["ep1"][0]
    for r in ref:
        for layer in range(2):
            high, low = metric_names(layer)
            # 4 experts: the most-loaded takes more than the mean, at most 4x; the least less.
            assert 1.0 < r[high] <= 4.0 and 0.0 <= r[low] < 1.0, r
    # Another layout rounds the router logits differently: a near-tie may route a token elsewhere.
    per_flip = 1 / (16 * 64 * 2 / 4)  # one token of the mean count (global batch x seq x top-k)
    for name, (rows, _) in runs.items():
        for r, want in zip(rows[:1], ref[:1]):
            for k in keys:
                assert abs(r[k] - want[k]) <= 2 * per_flip, (name, k, r[k], want[k])
