"""The hybrid family's checkpoints (``model=hybrid_tiny``: Mamba, attention and MLP layers)
across layouts, through the recipe's own model, optimizer and checkpoint code: every weight and
Adam moment exact, padding rows included.

One 4-process gloo world hosts every layout in turn. Each builds the model through
``recipes.run.worker.setup``, sets every weight, fp32 main param and Adam moment to a golden built
by hand (tests/helpers/layout_goldens.py: each parameter's full tensor holds
``k*1024 + row + (index in row)/256``, cut to a rank by slicing, Mamba's packed ``in_proj`` and
``conv1d`` component by component), saves through ``ckpt.io``, then loads every
checkpoint into each layout pre-filled with a sentinel and compares exactly.

Where the GTP shards fall (``in_proj`` 230 rows, ``z96 | x96 | B16 | C16 | dt6``, 115 a TP rank):
g2/a16 at tp1 cuts inside ``x`` (shards of 128); tp2 x g2/a16 cuts inside ``x`` of each TP
rank's rows (shards of 64, 13 padding rows after ``dt``); g4/a32 gives the 48-row ``out_proj``,
``linear_proj`` and ``linear_fc2`` shards of 32, 16, 0 and 0 rows (all padding on GTP ranks 2
and 3); g2/a1 cuts at row 115, row 19 of ``x``; pp2 puts layers 3-5 on stage 1 (their global
numbers in the checkpoint).

In bf16 (bf16 weights, fp32 main params): the plain and the distributed optimizer read each
other's files, ``conv1d``'s and ``in_proj``'s main params stored as their components
(``ckpt.adapt.optim_checkpoint.prepare_one``).
"""

from __future__ import annotations


import pytest

from layout_goldens import make_cfg, pair_problems, save_and_load_pairs
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
_PP2 = "parallelism.pipeline_model_parallel_size=2"
_DISTOPT = "optim.use_distributed_optimizer=true"
# name: (tp, g, pad_for_alignment, extra overrides); data parallel fills the world.
LAYOUTS = {
    "tp1": (1, 1, None, ()),
    "g2a16": (1, 2, 16, ()),
    "tp2g2a16": (2, 2, 16, ()),
    "g4a32": (1, 4, 32, ()),
    "g2a1": (1, 2, 1, ()),  # in_proj shards of 115 rows: rank 1 from row 19 of x
    "pp2dp2do": (1, 1, None, (_PP2, _DISTOPT)),
    "pp2g2a16": (1, 2, 16, (_PP2,)),
    "tp2g2a16do": (2, 2, 16, (_DISTOPT,)),
}


def test_every_weight_and_moment_of_the_hybrid_model_loads_exactly_at_every_layout(tmp_path):
    cfgs = {name: make_cfg("hybrid_tiny", tp, g, pad, WORLD, "logical", *extra)
            for name, (tp, g, pad, extra) in LAYOUTS.items()}
    results = run_distributed(save_and_load_pairs, WORLD, str(tmp_path), cfgs, timeout=1200)
    problems = pair_problems(results)
    assert not problems, "\n".join(problems[:40])


# bf16: plain (Float16 optimizer, fp32_param.<key>) and distributed (param.<key>) optimizers.
BF16_LAYOUTS = {
    "bf16 tp1": (1, 1, None, ()),
    "bf16 g2a16do": (1, 2, 16, (_DISTOPT,)),
    "bf16 tp2g2a16": (2, 2, 16, ()),
    "bf16 pp2dp2do": (1, 1, None, (_PP2, _DISTOPT)),
}


def test_bf16_main_params_and_moments_load_exactly_across_optimizer_kinds(tmp_path):
    cfgs = {name: make_cfg("hybrid_tiny", tp, g, pad, WORLD, "logical", "precision=bf16", *extra)
            for name, (tp, g, pad, extra) in BF16_LAYOUTS.items()}
    results = run_distributed(save_and_load_pairs, WORLD, str(tmp_path), cfgs, timeout=1200)
    problems = pair_problems(results)
    assert not problems, "\n".join(problems[:40])
