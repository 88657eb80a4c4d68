"""MoE checkpoints across expert layouts, on CPU: every expert weight, fp32 main param and Adam
moment restored exactly at other layouts, with megatron's plain and distributed optimizer and
with fp32 and bf16 parameters.

One 4-process gloo world hosts every layout in turn (megatron's process groups rebuilt for
each): moe_tiny (4 SwiGLU experts of width 100, hidden 72, 2 layers, Adam) at

* ``ep1``: tp1 x dp4, every rank holds all 4 experts (one optimizer);
* ``ep2do_bf16``: experts split over 2 ranks (a dense and an expert optimizer) with megatron's
  distributed optimizer (dense data parallel 4, expert data parallel 2: each rank holds a flat
  slice of each param's main param and moments) and bf16 weights;
* ``ep2etp2``: ep2 x expert tensor parallel 2 (each expert's [gate | up] fc1 split by rows);
* ``ep2egtp2``: ep2 x expert GTP 2 at alignment 16 (fc1 200 -> 224 rows, fc2 72 -> 96);
* ``tp2sp_ep2``: tp2 + sequence parallelism, ep2 x etp1;
* ``pp2ep2``: pipeline parallel 2 (one layer per stage) x ep2;
* ``ep4_bf16``: one expert per rank, bf16 weights (megatron's fp32 main params in the plain
  optimizer);
* ``egtp2do_bf16``: expert GTP 2 at alignment 16 with megatron's distributed optimizer (expert
  data parallel 2: each rank holds a flat slice of its expert GTP shard's main param and
  moments) and bf16 weights;
* with one multi-token prediction layer (``model.mtp_num_layers=1``, an MoE layer): ep1,
  pp2 x ep2 with the distributed optimizer in bf16, and ep2 x expert GTP 2;
* DeepSeek-V3-style routing (:data:`DEEPSEEK`: a dense first layer, 8 experts with sigmoid
  scores, the aux-loss-free expert bias, 4 groups of which a token picks 2, a shared expert):
  ep1, ep2 x expert GTP 2 and expert TP 2 with the distributed optimizer in bf16. Each reads
  the saves of the two others; each router's ``expert_bias`` (a buffer, not a
  param: no optimizer state) is set to a golden too and compared, and the built parameters
  are checked against the family's table (``recipes.families.parameter_shapes``).

Each layout builds the model through ``recipes.run.worker.setup``, sets every weight, fp32 main
param and Adam moment to a golden and saves through ``ckpt.io``; then each layout
loads the saves of three others (:data:`PAIRS`) into a model and optimizer pre-filled with a
sentinel and compares with ``torch.equal``.

The goldens are independent of the code under test: the full logical tensor of each parameter
(by its global name: layer ``stage offset + local index`` under pipeline parallelism; an
expert's of its global index ``ep_rank * local experts + i``) holds ``k*1024 + row + col/256``
(``k``: the parameter's index among the sorted logical names of the whole model; an
``expert_bias`` of layer ``l`` holds ``(16 l + e + 1) / 64``, exact in bf16), the fp32
main param the same, ``exp_avg = golden + 0.5``, ``exp_avg_sq = golden * 2``, ``step = 7``. A
rank's expected tensor is cut by plain slicing: the TP chunk (experts: the expert-TP chunk; a
gated fc1: gate rows then up rows of the rank), then under expert GTP the zero tail padding and
the rank's shard rows, and with the distributed optimizer the rank's flat range of it. bf16
weights are the golden rounded (the fp32 main params stay exact).
"""


from __future__ import annotations

import time

import pytest

from moe_matrix import (
    DS_LAYOUTS, DS_PAIRS, EP2, LAYOUTS, MTP_LAYOUTS, MTP_PAIRS, MUON, MUON_LAYOUTS,
    MUON_NO_EXPERTS_ON_A_STAGE, MUON_PAIRS, MUON_SELF, PAIRS, WORLD, make_cfg, matrix_worker,
)
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    cfgs = {name: make_cfg(*extra)
            for name, extra in {**LAYOUTS, **MUON_LAYOUTS, **MTP_LAYOUTS, **DS_LAYOUTS}.items()}
    cfgs[MUON_NO_EXPERTS_ON_A_STAGE] = make_cfg(
        *MUON, *EP2, "parallelism.pipeline_model_parallel_size=2", "model.moe_layer_freq=2")
    t0 = time.time()
    results = run_distributed(matrix_worker, WORLD, str(root), cfgs,
                              PAIRS + MUON_PAIRS + MUON_SELF + MTP_PAIRS + DS_PAIRS,
                              timeout=1200)
    print(f"\nMoE matrix: {time.time() - t0:.0f}s")
    return results


def test_the_pairs_cover_every_layout_three_times_each_way():
    for name in LAYOUTS:
        assert sum(dst == name for _, dst in PAIRS) == 3, name
        assert sum(src == name for src, _ in PAIRS) == 3, name
    assert len({frozenset(p) for p in PAIRS}) == len(PAIRS) == 24
    assert all(src != dst for src, dst in PAIRS)


def test_expert_layout_pairs_restore_weights_main_params_and_moments_exactly(matrix):
    pairs, failed = 0, []
    for rank, res in enumerate(matrix):
        for (src, dst), (experts, n, problems) in res["loads"].items():
            if problems:
                failed.append((rank, src, dst, len(problems), problems[:3]))
            no_experts_here = dst == MUON_NO_EXPERTS_ON_A_STAGE
            assert (experts > 0 or no_experts_here) and n > experts, (rank, src, dst, experts, n)
            pairs += 1
    assert not failed, failed
    assert pairs == WORLD * (len(PAIRS) + len(MUON_PAIRS) + len(MUON_SELF) + len(MTP_PAIRS)
                             + len(DS_PAIRS))
    assert sum(res["loads"][MUON_SELF[0]][0] for res in matrix) > 0
    # Expert GTP padded every expert weight on every rank (the padded branch ran).
    assert all(res["padded"]["ep2egtp2"] > 0 for res in matrix)
    assert all(res["padded"]["mtp_ep2egtp2"] > res["padded"]["ep2egtp2"] for res in matrix)
    # The optimizers the rows name: a dense and an expert one where experts are split.
    kinds = matrix[0]["kinds"]
    assert kinds["ep1"] == ["FP32Optimizer"], kinds
    assert kinds["pp2ep2"] == ["FP32Optimizer"] * 2, kinds
    assert kinds["ep4_bf16"] == ["Float16OptimizerWithFloat16Params"] * 2, kinds
    assert kinds["ep2do_bf16"] == ["DistributedOptimizer"] * 2, kinds


def test_muon_state_resumes_across_expert_splits_and_joins(matrix):
    """The Muon loads of the matrix (checked with the others above) crossed chains of both
    shapes: a Muon + Adam chain read a Muon + expert Muon + Adam one and back, each momentum
    buffer and Adam moment at its own param."""
    kinds = matrix[0]["kinds"]
    assert kinds["muon_ep1"] == kinds["muon_tp2"] == ["FP32Optimizer"] * 2, kinds
    assert kinds["muon_ep2"] == kinds["muon_egtp2"] == ["FP32Optimizer"] * 3, kinds
    assert {(a, b) for a, b in MUON_PAIRS if len(kinds[a]) != len(kinds[b])} >= {
        ("muon_ep1", "muon_ep2"), ("muon_ep2", "muon_ep1")}
    for res in matrix:
        assert all(res["loads"][pair][0] > 0 for pair in MUON_PAIRS)
    # The stage without MoE layers chains an expert Muon optimizer with no params.
    assert kinds[MUON_NO_EXPERTS_ON_A_STAGE] == ["FP32Optimizer"] * 3, kinds


def test_deepseek_routing_restores_the_expert_bias_across_expert_layouts(matrix):
    """The DeepSeek-style loads (their weights and moments checked above): each router's
    ``expert_bias`` equals its golden in fp32 after every load, on every rank (one MoE layer:
    one bias per rank), and megatron built the parameters of the family's table at each
    layout (the dense first layer, the shared expert, 8 experts split by EP, ETP, expert GTP)."""
    failed = []
    for rank, res in enumerate(matrix):
        for pair in DS_PAIRS:
            count, problems = res["biases"][pair]
            if count != 1 or problems:
                failed.append((rank, pair, count, problems[:3]))
        for name in DS_LAYOUTS:
            if res["table"][name]:
                failed.append((rank, name, "table", res["table"][name][:5]))
        # the other layouts have no expert bias to compare
        assert all(res["biases"][pair][0] == 0 for pair in PAIRS + MTP_PAIRS)
    assert not failed, failed
    kinds = matrix[0]["kinds"]
    assert kinds["ds_ep1"] == ["FP32Optimizer"], kinds
    assert kinds["ds_etp2do_bf16"] == ["DistributedOptimizer"] * 2, kinds
    assert all(res["padded"]["ds_ep2egtp2"] > 0 for res in matrix)
