"""LLaVA checkpoints in megatron-core 0.19.2's own (stock, padded) format, for
tests/test_llava_stock.py: saved with ``tests/helpers/module_layouts.py``'s goldens and the
common state a gtp-recipes run records (``layout``, ``train_state.config``; no sharding record
record, as megatron's own writer leaves it), then loaded through the project's load path
(``ckpt.stock.prepare_load``, then the logical format) into sentinel-filled targets.
"""

from __future__ import annotations

import os

import torch

import layout_goldens
import module_layouts

ITER = "iter_0000001"


def common(tp: int, g: int, pad) -> dict:
    """The common state a run of ``llava_tiny`` (non-gated language MLP, tests/helpers/llava.py)
    at ``tp`` x ``g``/``pad`` records: its layout and its run config."""
    from omegaconf import OmegaConf

    from compose import make_cfg

    cfg = make_cfg("model=llava_tiny", "data=shapes", "model.swiglu=false",
                   f"parallelism.tensor_model_parallel_size={tp}", f"gtp.gtp_remat_size={g}",
                   f"gtp.pad_for_alignment={'null' if pad is None else pad}")
    return {"iteration": 1, "layout": {"tensor_model_parallel_size": tp, "gtp_remat_size": g,
                                      "pad_for_alignment": pad or 0},
            "train_state": {"config": OmegaConf.to_container(cfg)}}


def save_stock_and_load(builder: str, root: str, saves: dict, loads: list):
    """Each layout of ``saves`` (``name: (tp, g, pad, distributed optimizer)``) writes its goldens
    in the stock format to ``root/<name>/iter_0000001``; then each ``(source, target)`` of
    ``loads`` is loaded as ``ckpt.io`` does (:func:`ckpt.stock.prepare_load`, which
    converts a padded one, then megatron's load with the logical format installed) into a
    sentinel-filled module and optimizer at the target layout. Returns
    ``{(source, target): layout_goldens.check()}``."""
    from megatron.core import dist_checkpointing

    from ckpt import stock

    for name, (tp, g, pad, do) in saves.items():
        module_layouts.setup(builder, tp, g, pad, "stock")
        module, ddp, opt = module_layouts.build(builder, tp, g, do)
        layout_goldens.fill(ddp, opt, None, sentinel=False)
        path = os.path.join(root, name, ITER)
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
            with open(os.path.join(root, name, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1\n")
        torch.distributed.barrier()
        state = module_layouts.sharded_state(ddp, opt, loading=False)
        dist_checkpointing.save({**state, **common(tp, g, pad)}, path)
    out = {}
    for target in dict.fromkeys(t for _, t in loads):  # one build per target, in order
        tp, g, pad, do = saves[target] if target in saves else module_layouts.LAYOUTS[target]
        module_layouts.setup(builder, tp, g, pad, "logical")
        module, ddp, opt = module_layouts.build(builder, tp, g, do)
        for source in (s for s, t in loads if t == target):
            path = os.path.join(root, source, ITER)
            path, _ = stock.prepare_load(path, dist_checkpointing.load_common_state_dict(path))
            out[(source, target)] = module_layouts.load_and_check(module, ddp, opt, str(path))
    return out
