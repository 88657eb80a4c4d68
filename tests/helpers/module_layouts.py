"""One megatron module (a Mamba mixer, a CLIP ViT...) at many parallel layouts in one gloo world,
for tests of forward/backward and of checkpoints, weights and Adam moments.

A *builder* is a helper module (``tests/helpers/mamba_mixer.py``, ``tests/helpers/gdn_net.py``,
``tests/helpers/vit.py``)
with ``install()`` (its shims), ``build(tp)`` (the module, whose ``config`` megatron's DDP
takes) and ``loss(model)`` (a scalar from a fixed input, the same on every rank). Builders are
named by module so that the functions here can run inside :func:`multiproc.run_distributed`.

The goldens, their fill and the exact comparison are ``tests/helpers/layout_goldens.py``'s
(each parameter's tp1 tensor holds ``k*1024 + row + (index in row)/256``, cut to a rank by
hand, packed components one by one).
"""

from __future__ import annotations

import importlib
import os

import torch

import layout_goldens
from multiproc import reset_model_parallel

# name: (tp, g, pad_for_alignment, distributed optimizer); data parallel fills a world of 4.
LAYOUTS = {
    "tp1": (1, 1, None, False),
    "tp2": (2, 1, None, False),
    "g2a16": (1, 2, 16, False),
    "g4a32": (1, 4, 32, False),
    "tp2g2a16": (2, 2, 16, False),
    "g4a1": (1, 4, 1, False),  # shard boundaries at odd rows (Mamba: 41 rows, x from row 18)
    "g2a16dp2do": (1, 2, 16, True),
    "tp2dp2do": (2, 1, None, True),
}
# Layouts whose forward and backward are compared with tp1's.
COMPARED = ("tp2", "g2a16", "g4a32", "tp2g2a16")


def setup(builder: str, tp: int, g: int, pad, fmt: str = "logical"):
    """The project's shims, the builder's, and megatron's process groups for ``tp`` x ``g``
    (seed 1234); returns the builder module."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    from gtp import alignment, backend, grad_stats
    from ckpt.format import logical_format
    from mcore_compat import cpu, distrib_optimizer

    cpu.install()
    distrib_optimizer.install()  # as recipes.run.worker
    module = importlib.import_module(builder)
    module.install()
    logical_format.configure(fmt)
    reset_model_parallel()
    if g > 1:
        backend.install()
        grad_stats.install()
        gtp_impl.configure_gtp_remat_from_recipe(fp4=False, fp8=False, fp8_recipe=None)
        alignment.apply_pad_for_alignment(pad)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, gtp_remat_size=g)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    return module


def build(builder: str, tp: int, g: int, distributed_optimizer: bool = False):
    """(module, DDP-wrapped module, megatron Adam) at the layout :func:`setup` made."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    module = importlib.import_module(builder).build(tp)
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), module)
    if g > 1:
        gtp_impl.classify_gtp_remat_chains(ddp)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed_optimizer,
        params_dtype=torch.float32), [ddp])
    return module, ddp, opt


def local(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's piece of a tp1 tensor, by hand (``layout_goldens.local``: the TP chunk of
    each packed component in turn, megatron's GTP tail padding with zeros, the rank's rows)."""
    return layout_goldens.local(full, p, "", None)


def forward_backward(builder: str, layouts: dict):
    """``{name: (|loss - tp1 loss|, max |grad - tp1 grad|, number of grads)}`` for each layout
    ``name: (tp, g, pad)``, the module holding the tp1 module's weights."""
    mod = setup(builder, 1, 1, None)
    ref_module, ref_ddp, _ = build(builder, 1, 1)
    ref = {n: p.detach().clone() for n, p in ref_module.named_parameters()}
    ref_loss, ref_grads = _loss_and_grads(mod, ref_ddp, ref_module)
    out = {}
    for name, (tp, g, pad) in layouts.items():
        mod = setup(builder, tp, g, pad)
        module, ddp, _ = build(builder, tp, g)
        params = dict(module.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(local(ref[n], p))
        loss, grads = _loss_and_grads(mod, ddp, module)
        worst = max((grads[n] - local(ref_grads[n], params[n])).abs().max().item() for n in grads)
        out[name] = (abs(loss.item() - ref_loss.item()), worst, len(grads))
    return out


def forward_backward_each(builders: tuple, layouts: dict) -> dict:
    """``{builder: forward_backward(builder, layouts)}``: several modules in one world."""
    return {builder: forward_backward(builder, layouts) for builder in builders}


def differences_from_tp1(result: dict, n_params: int) -> list[str]:
    """:func:`forward_backward`'s result checked: every layout computes ``n_params`` gradients,
    and its loss and gradients equal tp1's (up to fp32 round-off of the TP all-reduce at
    tp > 1, 1e-6; exactly under GTP alone)."""
    out = []
    for name, (dloss, dgrad, n) in result.items():
        # GTP alone is exact on any CPU: the GEMMs see the gathered (unpadded) weight, data
        # movement, and the reduce-scatter sums g identical partial gradients scaled by 1/g
        # (every rank reads the same input), exact for g = 2 and 4, powers of two.
        tol = 1e-6 if LAYOUTS[name][0] > 1 else 0.0
        if n != n_params or dloss > tol or dgrad > tol:
            out.append(f"{name}: {n} grads, |dloss| {dloss:g}, max |dgrad| {dgrad:g}")
    return out


def _loss_and_grads(mod, ddp, module):
    loss = mod.loss(ddp)
    loss.backward()
    return loss.detach(), {n: (p.main_grad if getattr(p, "main_grad", None) is not None
                               else p.grad).detach().clone() for n, p in module.named_parameters()}


def sharded_state(ddp, opt, loading: bool) -> dict:
    """``{"model", "optimizer"}`` sharded state dicts, as ``ckpt.io`` builds them."""
    from ckpt.io.state import optimizer_metadata

    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(
        model_sd, is_loading=loading, metadata=optimizer_metadata(opt))}


def save_and_load_all(builder: str, root: str, layouts: dict, fmt: str = "logical"):
    """Each layout ``name: (tp, g, pad, distributed optimizer)`` saves its goldens to
    ``root/<name>``; then each loads every checkpoint of the same optimizer kind (a change of
    kind goes through ``ckpt.adapt.optim_checkpoint``, tested with GPT) into a sentinel-filled
    module and optimizer. Returns ``{"records": {name: sharding-record tensors}, (source, target):
    check()}``."""
    from megatron.core import dist_checkpointing

    from ckpt.format.sharding_record import sharding_record

    records = {}
    for name, (tp, g, pad, do) in layouts.items():
        setup(builder, tp, g, pad, fmt)
        module, ddp, opt = build(builder, tp, g, do)
        layout_goldens.fill(ddp, opt, None, sentinel=False)
        path = os.path.join(root, name)
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        state = sharded_state(ddp, opt, loading=False)
        records[name] = sharding_record(ddp, state["model"], logical=fmt == "logical")["tensors"]
        dist_checkpointing.save(state, path)
    out = {"records": records}
    # One build per target, the last saved layout's reused as its target (built last, so
    # megatron's state is still its own): each load starts from a sentinel fill of every tensor.
    for i, (name, (tp, g, pad, do)) in enumerate(reversed(layouts.items())):
        if i > 0:
            setup(builder, tp, g, pad, fmt)
            module, ddp, opt = build(builder, tp, g, do)
        for source in (s for s, lay in layouts.items() if lay[3] == do):
            out[(source, name)] = load_and_check(module, ddp, opt, os.path.join(root, source))
    return out


def load_and_check(module, ddp, opt, path: str):
    """Fill the module and optimizer with the sentinel, load the checkpoint at ``path`` into
    them, and return ``layout_goldens.check()``."""
    from megatron.core import dist_checkpointing

    layout_goldens.fill(ddp, opt, None, sentinel=True)
    loaded = dist_checkpointing.load(sharded_state(ddp, opt, loading=True), path)
    module.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    return layout_goldens.check(ddp, opt, None)


def failures(results: list, layouts: dict, n_params: int) -> list[str]:
    """The problems of :func:`save_and_load_all`'s per-rank results, one line each; with a plain
    optimizer every rank checks all ``n_params`` weights and their main param and Adam state
    (five comparisons each: ``layout_goldens.check``)."""
    out = []
    for rank, res in enumerate(results):
        for key, (n, problems) in ((k, v) for k, v in res.items() if k != "records"):
            source, target = key
            if not layouts[target][3] and n != 5 * n_params:
                out.append(f"rank {rank} {target}: {n} comparisons, not 5 x {n_params}")
            out += [f"rank {rank} {source} -> {target}: {p}" for p in problems]
    return out
