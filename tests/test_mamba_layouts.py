"""megatron-core's ``MambaMixer`` on CPU under TP x GTP: the torch kernels
(``mcore_compat.mamba_cpu``) and the logical checkpoint of the packed ``in_proj``
(``gtp.mamba_format``), every weight and Adam moment across layouts.

One 4-process gloo world hosts every layout in turn (tests/helpers/module_layouts.py; the
mixer, its dims and where the GTP shards fall: tests/helpers/mamba_mixer.py). Goldens are
built independently of the code under test: each parameter's tp1 tensor holds ``k*1024 + row + (index in row)/256`` (``k``: its index in sorted
name order), ``exp_avg = golden + 0.5``, ``exp_avg_sq = golden * 2``, ``step = 7``; a rank's
expected tensor is cut by hand (the TP chunk of each packed component, megatron's GTP tail
padding with zeros, the rank's shard; a distributed optimizer's flat range). Every layout saves
its goldens; every layout loads every checkpoint of the same optimizer kind (plain Adam, or the
distributed optimizer) into a model and optimizer filled with a sentinel and compares exactly,
padding rows included.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import module_layouts
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
BUILDER = "mamba_mixer"
# name: (tp, g, pad_for_alignment, distributed optimizer); data parallel fills the world.
LAYOUTS = {
    "tp1": (1, 1, None, False),
    "tp2": (2, 1, None, False),
    "g2a16": (1, 2, 16, False),
    "g4a32": (1, 4, 32, False),
    "tp2g2a16": (2, 2, 16, False),
    "g2a16dp2do": (1, 2, 16, True),
    "tp2dp2do": (2, 1, None, True),
}
# conv1d weight and bias, dt_bias, A_log, D, in_proj, norm, out_proj
N_PARAMS = 8


def test_mixer_matches_tp1_at_every_layout():
    layouts = {n: LAYOUTS[n][:3] for n in ("tp2", "g2a16", "g4a32", "tp2g2a16")}
    res = run_distributed(module_layouts.forward_backward, WORLD, BUILDER, layouts, timeout=300)
    for name, (dloss, dgrad, n) in res[0].items():
        assert n == N_PARAMS, (name, n)
        # tp2 sums partial results in another order: fp32 round-off only.
        tol = 1e-6 if LAYOUTS[name][0] > 1 else 0.0
        assert dloss <= tol and dgrad <= tol, (name, dloss, dgrad)


def test_every_weight_and_moment_loads_exactly_at_every_layout():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(module_layouts.save_and_load_all, WORLD, BUILDER, root,
                                  LAYOUTS, timeout=900)
    records = results[0]["records"]
    assert records["g2a16"]["in_proj.weight"]["components"] == [
        [".z", 64], [".x", 64], [".B", 16], [".C", 16], [".dt", 4]]
    assert records["tp2g2a16"]["in_proj.weight"]["components"] == [
        [".z", 32], [".x", 32], [".B", 8], [".C", 8], [".dt", 2]]
    problems = module_layouts.failures(results, LAYOUTS, N_PARAMS)
    assert not problems, "\n".join(problems[:40])


def _stock_model_file(root: str):
    """The stock format at g2/a16 (megatron's own gather of in_proj, run without grad by
    gtp.mamba_format): the model file saves, and a tp1 mixer without GTP loads it exactly."""
    from megatron.core import dist_checkpointing

    module_layouts.setup(BUILDER, 1, 2, 16, "stock")
    mixer, ddp, opt = module_layouts.build(BUILDER, 1, 2)
    module_layouts.fill(mixer, opt, sentinel=False)
    dist_checkpointing.save(ddp.module.sharded_state_dict(), root)
    module_layouts.setup(BUILDER, 1, 1, None, "logical")
    mixer, ddp, opt = module_layouts.build(BUILDER, 1, 1)
    module_layouts.fill(mixer, opt, sentinel=True)
    mixer.load_state_dict(dist_checkpointing.load(ddp.module.sharded_state_dict(), root),
                          strict=True)
    gold = module_layouts.goldens(mixer)
    return [name for name, p, (want, _, _) in gold.values() if not torch.equal(p.detach(), want)]


def test_stock_format_model_file_saves_on_gloo_and_loads_without_gtp():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_stock_model_file, WORLD, root, timeout=300)
    assert results == [[]] * WORLD
