"""megatron-core's LLaVAModel (the LLaVA family's build of llava_tiny, tests/helpers/llava.py)
under TP x GTP: forward and backward against tp1, and every weight and Adam moment through the
logical checkpoint between tp1, g2/a16 (the ViT's fc1 pads 24 rows), g4/a32 (the last GTP shard
of the ViT's linear_proj / linear_fc2 is all padding) and tp2 x g2/a16.

Goldens, sentinels and the comparison: tests/helpers/module_layouts.py (built by hand, exact,
padding rows included).

In bf16 through the recipe's own model, optimizer and checkpoint code (tests/helpers/
layout_goldens.py): bf16 weights, fp32 main params and Adam moments between the plain and the
distributed optimizer at tp1, g2/a16, g4/a32 and tp2 x g2/a16.
"""

from __future__ import annotations

import tempfile

import pytest

import module_layouts
from layout_goldens import make_cfg, pair_problems, save_and_load_pairs
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
BUILDER = "llava"
LAYOUTS = {n: module_layouts.LAYOUTS[n] for n in ("tp1", "g2a16", "g4a32", "tp2g2a16")}
# language model 15 (untied, non-gated), ViT 29, projector 4
N_PARAMS = 48


def test_llava_matches_tp1_and_every_weight_and_moment_loads_exactly_at_every_layout():
    layouts = {n: LAYOUTS[n][:3] for n in ("g2a16", "g4a32", "tp2g2a16")}
    res = run_distributed(module_layouts.forward_backward, WORLD, BUILDER, layouts, timeout=300)
    problems = module_layouts.differences_from_tp1(res[0], N_PARAMS)
    assert not problems, problems
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(module_layouts.save_and_load_all, WORLD, BUILDER, root,
                                  LAYOUTS, timeout=900)
    records = results[0]["records"]
    fc1 = records["g2a16"]["vision_model.decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1["L"], fc1["pad"], fc1["shard_rows"]) == (200, 24, 112)
    proj = records["g4a32"]["vision_model.decoder.layers.self_attention.linear_proj.weight"]
    assert (proj["L"], proj["pad"], proj["shard_rows"]) == (72, 56, 32)  # rank 3: padding only
    projector = records["tp2g2a16"]["vision_projection.encoder.linear_fc1.weight"]
    assert (projector["L"], projector["pad"], projector["shard_rows"]) == (64, 0, 32)
    problems = module_layouts.failures(results, LAYOUTS, N_PARAMS)
    assert not problems, "\n".join(problems[:40])


_DISTOPT = "optim.use_distributed_optimizer=true"
# name: (tp, g, pad_for_alignment, extra overrides); data parallel fills the world.
BF16_LAYOUTS = {
    "bf16 tp1": (1, 1, None, ()),
    "bf16 g2a16do": (1, 2, 16, (_DISTOPT,)),
    "bf16 g4a32": (1, 4, 32, ()),
    "bf16 tp2g2a16do": (2, 2, 16, (_DISTOPT,)),
}


def test_bf16_weights_main_params_and_moments_load_exactly_across_optimizer_kinds(tmp_path):
    cfgs = {name: make_cfg("llava_tiny", tp, g, pad, WORLD, "logical", "data=shapes",
                           "precision=bf16", *extra)
            for name, (tp, g, pad, extra) in BF16_LAYOUTS.items()}
    results = run_distributed(save_and_load_pairs, WORLD, str(tmp_path), cfgs, timeout=1200)
    problems = pair_problems(results)
    assert not problems, "\n".join(problems[:40])
