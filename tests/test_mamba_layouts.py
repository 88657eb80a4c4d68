"""megatron-core's ``MambaMixer`` on CPU under TP x GTP: the torch kernels
(``mcore_compat.mamba_cpu``) and the logical checkpoint of the packed ``in_proj``
(``gtp.mamba_format``), every weight and Adam moment across layouts.

One 4-process gloo world hosts every layout in turn (tests/helpers/mamba_mixer.py: dims,
and where the GTP shards fall). Goldens are built independently of the code under test: each
parameter's tp1 tensor holds ``k*1024 + row + (index in row)/256`` (``k``: its index in sorted
name order), ``exp_avg = golden + 0.5``, ``exp_avg_sq = golden * 2``, ``step = 7``; a rank's
expected tensor is cut by hand (the TP chunk of each packed component, megatron's GTP tail
padding with zeros, the rank's shard; a distributed optimizer's flat range). Every layout saves
its goldens; every layout loads every checkpoint of the same optimizer kind (plain Adam, or the
distributed optimizer) into a model and optimizer filled with a sentinel and compares exactly,
padding rows included.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from mamba_mixer import full_shape, golden_full, local
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
SENTINEL, STEP = -999.0, 7.0
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


def _forward_backward(layouts):
    """Loss and every gradient at each layout against the tp1 mixer with the same weights."""
    import mamba_mixer as mm

    mm.setup(1, 1, None)
    ref_mixer, ref_ddp, _ = mm.build(1, 1)
    ref = {n: p.detach().clone() for n, p in ref_mixer.named_parameters()}
    ref_loss, ref_grads = mm.loss_and_grads(ref_ddp, ref_mixer)
    out = {}
    for name in layouts:
        tp, g, pad, _ = LAYOUTS[name]
        mm.setup(tp, g, pad)
        mixer, ddp, _ = mm.build(tp, g)
        params = dict(mixer.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(local(ref[n], p))
        loss, grads = mm.loss_and_grads(ddp, mixer)
        worst = max((grads[n] - local(ref_grads[n], params[n])).abs().max().item() for n in grads)
        out[name] = (abs(loss.item() - ref_loss.item()), worst, len(grads))
    return out


def test_mixer_matches_tp1_at_every_layout():
    res = run_distributed(_forward_backward, WORLD, ("tp2", "g2a16", "g4a32", "tp2g2a16"),
                          timeout=300)
    for name, (dloss, dgrad, n) in res[0].items():
        assert n == 8, (name, n)  # conv1d weight and bias, dt_bias, A_log, D, in_proj, norm, out_proj
        # tp2 sums partial results in another order: fp32 round-off only.
        tol = 1e-6 if LAYOUTS[name][0] > 1 else 0.0
        assert dloss <= tol and dgrad <= tol, (name, dloss, dgrad)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------
def _goldens(mixer):
    """{id(param): (name, (weight, exp_avg, exp_avg_sq) expected on this rank)}."""
    out = {}
    for k, (name, p) in enumerate(sorted(mixer.named_parameters()), start=1):
        full = golden_full(k, full_shape(p))
        out[id(p)] = (name, p, tuple(local(t, p) for t in (full, full + 0.5, full * 2)))
    return out


def _cut(t, sl):
    return t if sl is None else t.reshape(-1)[sl]


@torch.no_grad()
def _fill(mixer, opt, sentinel: bool) -> None:
    from optimizer_entries import main_param_entries

    gold = _goldens(mixer)
    for _, p, (want, _, _) in gold.values():
        p.copy_(torch.full_like(p, SENTINEL) if sentinel else want)
    for torch_opt, p, main, sl in main_param_entries(opt):
        want, m, v = gold[id(p)][2]
        state = torch_opt.state[main]
        for key, value in (("main", want), ("exp_avg", m), ("exp_avg_sq", v)):
            dst = main if key == "main" else state[key]
            dst.copy_(torch.full_like(dst, SENTINEL) if sentinel else _cut(value, sl))
        state["step"] = torch.tensor(SENTINEL if sentinel else STEP)


@torch.no_grad()
def _check(mixer, opt) -> list[str]:
    from optimizer_entries import main_param_entries

    gold = _goldens(mixer)
    problems = []

    def compare(what, got, want):
        if got.shape != want.shape or not torch.equal(got, want):
            bad = int((got != want).sum()) if got.shape == want.shape else "shape"
            problems.append(f"{what}: {bad} elements differ")

    for name, p, (want, _, _) in gold.values():
        compare(f"{name} weight", p.detach(), want)
    seen = set()
    for torch_opt, p, main, sl in main_param_entries(opt):
        name, _, (want, m, v) = gold[id(p)]
        seen.add(name)
        state = torch_opt.state[main]
        compare(f"{name} main param", main.detach(), _cut(want, sl))
        compare(f"{name} exp_avg", state["exp_avg"], _cut(m, sl))
        compare(f"{name} exp_avg_sq", state["exp_avg_sq"], _cut(v, sl))
        if float(state["step"]) != STEP:
            problems.append(f"{name} step {float(state['step'])}")
    return problems, sorted(seen)


def _state(ddp, opt, loading: bool):
    from recipes.checkpoint.state import optimizer_metadata

    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(
        model_sd, is_loading=loading, metadata=optimizer_metadata(opt))}


def _save_and_load_all(root: str, names, fmt: str):
    """Each layout saves its goldens to ``root/<name>``; then each loads every one."""
    import mamba_mixer as mm
    from megatron.core import dist_checkpointing

    from gtp.gtp_layout_record import gtp_layout_record

    records = {}
    for name in names:
        tp, g, pad, do = LAYOUTS[name]
        mm.setup(tp, g, pad, fmt)
        mixer, ddp, opt = mm.build(tp, g, do)
        _fill(mixer, opt, sentinel=False)
        path = os.path.join(root, name)
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        state = _state(ddp, opt, loading=False)
        records[name] = gtp_layout_record(ddp, state["model"], logical=True)["tensors"]
        dist_checkpointing.save(state, path)
    out = {"records": records}
    for name in names:
        tp, g, pad, do = LAYOUTS[name]
        # A change of optimizer kind goes through recipes.optim_checkpoint (tested with GPT).
        for source in (s for s in names if LAYOUTS[s][3] == do):
            mm.setup(tp, g, pad, fmt)
            mixer, ddp, opt = mm.build(tp, g, do)
            _fill(mixer, opt, sentinel=True)
            loaded = dist_checkpointing.load(_state(ddp, opt, loading=True),
                                             os.path.join(root, source))
            mixer.load_state_dict(loaded["model"], strict=True)
            opt.load_state_dict(loaded["optimizer"])
            out[(source, name)] = _check(mixer, opt)
    return out


def test_every_weight_and_moment_loads_exactly_at_every_layout():
    names = tuple(LAYOUTS)
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_save_and_load_all, WORLD, root, names, "logical",
                                  timeout=900)
    assert results[0]["records"]["g2a16"]["in_proj.weight"]["components"] == [
        [".z", 64], [".x", 64], [".B", 16], [".C", 16], [".dt", 4]]
    assert results[0]["records"]["tp2g2a16"]["in_proj.weight"]["components"] == [
        [".z", 32], [".x", 32], [".B", 8], [".C", 8], [".dt", 2]]
    failures = []
    for rank, res in enumerate(results):
        res.pop("records")
        for (source, target), (problems, seen) in res.items():
            assert len(seen) == 8 or LAYOUTS[target][3], (target, seen)
            failures += [f"rank {rank} {source} -> {target}: {p}" for p in problems]
    assert not failures, "\n".join(failures[:40])


def _stock_model_file(root: str):
    """The stock format at g2/a16 (megatron's own gather of in_proj, run without grad by
    gtp.mamba_format): the model file saves, and a tp1 mixer without GTP loads it exactly."""
    import mamba_mixer as mm
    from megatron.core import dist_checkpointing

    mm.setup(1, 2, 16, "stock")
    mixer, ddp, opt = mm.build(1, 2)
    _fill(mixer, opt, sentinel=False)
    dist_checkpointing.save(ddp.module.sharded_state_dict(), root)
    mm.setup(1, 1, None, "logical")
    mixer, ddp, opt = mm.build(1, 1)
    _fill(mixer, opt, sentinel=True)
    mixer.load_state_dict(dist_checkpointing.load(ddp.module.sharded_state_dict(), root),
                          strict=True)
    gold = _goldens(mixer)
    return [name for name, p, (want, _, _) in gold.values() if not torch.equal(p.detach(), want)]


def test_stock_format_model_file_saves_on_gloo_and_loads_without_gtp():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_stock_model_file, WORLD, root, timeout=300)
    assert results == [[]] * WORLD

