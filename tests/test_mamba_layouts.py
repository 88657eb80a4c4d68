"""megatron-core's ``MambaMixer`` on CPU under TP x GTP: the torch kernels
(``mcore_compat.mamba_cpu``) and the logical checkpoint of the packed ``in_proj``
(``ckpt.format.mamba_format``), every weight and Adam moment across layouts. In the same world,
megatron-core's ``GatedDeltaNet`` as the hybrid family builds it (``mcore_compat.gdn_cpu``;
tests/helpers/gdn_net.py): its loss and every gradient at tp2, g2/a16, g4/a32 and tp2 x g2/a16
are tp1's (its checkpoints across layouts: tests/test_hybrid_layouts.py), and its stock format:
refused by name under GTP, read exactly without.

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

import layout_goldens
import module_layouts
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
BUILDER = "mamba_mixer"
LAYOUTS = module_layouts.LAYOUTS
# conv1d weight and bias, dt_bias, A_log, D, in_proj, norm, out_proj
N_PARAMS = 8
# GatedDeltaNet: dt_bias, A_log, in_proj, conv1d, out_norm, out_proj
GDN_PARAMS = 6


def test_mixer_and_gated_delta_net_match_tp1_at_every_layout():
    layouts = {n: LAYOUTS[n][:3] for n in module_layouts.COMPARED}
    res = run_distributed(module_layouts.forward_backward_each, WORLD, (BUILDER, "gdn_net"),
                          layouts, timeout=300)
    problems = module_layouts.differences_from_tp1(res[0][BUILDER], N_PARAMS)
    problems += [f"GatedDeltaNet {p}" for p in
                 module_layouts.differences_from_tp1(res[0]["gdn_net"], GDN_PARAMS)]
    assert not problems, problems


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
    ckpt.format.mamba_format): the model file saves, and a tp1 mixer without GTP loads it exactly."""
    from megatron.core import dist_checkpointing

    module_layouts.setup(BUILDER, 1, 2, 16, "stock")
    mixer, ddp, opt = module_layouts.build(BUILDER, 1, 2)
    layout_goldens.fill(ddp, opt, None, sentinel=False)
    dist_checkpointing.save(ddp.module.sharded_state_dict(), root)
    module_layouts.setup(BUILDER, 1, 1, None, "logical")
    mixer, ddp, opt = module_layouts.build(BUILDER, 1, 1)
    layout_goldens.fill(ddp, opt, None, sentinel=True)
    mixer.load_state_dict(dist_checkpointing.load(ddp.module.sharded_state_dict(), root),
                          strict=True)
    gold = layout_goldens.layout_goldens(ddp, None)
    return [name for p, name, (want, _, _) in gold.values() if not torch.equal(p.detach(), want)]


def _gdn_stock_files(root: str):
    """GatedDeltaNet in the stock format: at g2/a16 megatron-core 0.19.2 cannot save it (its
    method asserts on the GTP in_proj; ckpt.format.gdn_format refuses it by name); at tp2
    megatron's own method saves it, and a tp1 x g2/a16 module in the logical format loads that
    file exactly (megatron's non-GTP file is the logical layout)."""
    from megatron.core import dist_checkpointing

    from ckpt.format.logical_factory import GTPCheckpointError

    module_layouts.setup("gdn_net", 1, 2, 16, "stock")
    net, ddp, opt = module_layouts.build("gdn_net", 1, 2)
    try:
        ddp.module.sharded_state_dict()
        refusal = None
    except GTPCheckpointError as e:
        refusal = str(e)
    module_layouts.setup("gdn_net", 2, 1, None, "stock")
    net, ddp, opt = module_layouts.build("gdn_net", 2, 1)
    layout_goldens.fill(ddp, opt, None, sentinel=False)
    dist_checkpointing.save(ddp.module.sharded_state_dict(), root)
    module_layouts.setup("gdn_net", 1, 2, 16, "logical")
    net, ddp, opt = module_layouts.build("gdn_net", 1, 2)
    layout_goldens.fill(ddp, opt, None, sentinel=True)
    net.load_state_dict(dist_checkpointing.load(ddp.module.sharded_state_dict(), root),
                        strict=True)
    gold = layout_goldens.layout_goldens(ddp, None)
    return refusal, [name for p, name, (want, _, _) in gold.values()
                     if not torch.equal(p.detach(), want)]


def _stock_files(root: str):
    import os

    if torch.distributed.get_rank() == 0:
        os.makedirs(f"{root}/mamba"), os.makedirs(f"{root}/gdn")
    torch.distributed.barrier()
    return _stock_model_file(f"{root}/mamba"), _gdn_stock_files(f"{root}/gdn")


def test_stock_format_model_file_saves_on_gloo_and_loads_without_gtp():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_stock_files, WORLD, root, timeout=300)
    assert [mamba for mamba, _ in results] == [[]] * WORLD
    for refusal, wrong in (gdn for _, gdn in results):
        assert wrong == []
        assert refusal is not None and "in_proj.weight: megatron-core 0.19.2's stock format " \
            "cannot save GatedDeltaNet's GTP in_proj" in refusal, refusal
