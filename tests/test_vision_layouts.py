"""megatron-core's CLIP ViT on CPU without TransformerEngine under TP x GTP
(``mcore_compat.vision_cpu``): forward and backward against tp1, and every weight and Adam
moment through the logical checkpoint across layouts, including the two vision cases the GTP
checkpoint fix was made for (tests/helpers/vit.py: an fc1 that pads 24 rows at g2/a16; a last
GTP shard of ``linear_proj`` / ``linear_fc2`` that is all padding at g4/a32).

Goldens, sentinels and the comparison: tests/helpers/module_layouts.py (built by hand, exact,
padding rows included).
"""

from __future__ import annotations

import tempfile

import pytest

import module_layouts
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
BUILDER = "vit"
LAYOUTS = module_layouts.LAYOUTS
N_PARAMS = 29  # conv1, class token, position embedding, ln_pre, 2 layers of 12


def test_vit_matches_tp1_at_every_layout():
    layouts = {n: LAYOUTS[n][:3] for n in module_layouts.COMPARED}
    res = run_distributed(module_layouts.forward_backward, WORLD, BUILDER, layouts, timeout=300)
    problems = module_layouts.differences_from_tp1(res[0], N_PARAMS)
    assert not problems, problems


def test_every_weight_and_moment_loads_exactly_at_every_layout():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(module_layouts.save_and_load_all, WORLD, BUILDER, root,
                                  LAYOUTS, timeout=900)
    records = results[0]["records"]
    fc1 = records["g2a16"]["decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1["L"], fc1["pad"], fc1["shard_rows"]) == (200, 24, 112)
    proj = records["g4a32"]["decoder.layers.self_attention.linear_proj.weight"]
    assert (proj["L"], proj["pad"], proj["shard_rows"]) == (72, 56, 32)  # rank 3: padding only
    problems = module_layouts.failures(results, LAYOUTS, N_PARAMS)
    assert not problems, "\n".join(problems[:40])
