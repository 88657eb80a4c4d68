"""Muon checkpoints across dense layouts, on CPU: every weight, fp32 main param, Muon momentum
buffer, Adam moment and Adam step restored exactly at other layouts, with megatron's plain
Muon and its layer-wise distributed optimizer (under GTP too).

One 4-process gloo world hosts every layout in turn. ``optim=muon`` gives megatron's
``TensorParallelMuon`` the 2-D weights and Adam the rest (norms, embeddings, output layer):

* fp32, plain optimizer: ``tp1`` (dp4), ``tp2`` (dp2), ``g2a16`` (GTP 2 at alignment 16,
  dp2), ``tp2g2a32`` (tp2 x GTP 2 at alignment 32);
* bf16 (a Muon resume keeps its precision): ``bf16`` (plain, fp32 main params), and the
  layer-wise distributed optimizer (each Muon weight stepped whole by one data-parallel rank;
  Adam's state sharded by megatron's ``DistributedOptimizer``) at ``do`` (dp4),
  ``g2a16do`` (GTP 2, sharded over the data-parallel group without the GTP axis) and
  ``tp2do`` (tp2 x dp2).

Each layout saves its goldens through ``ckpt.io``, then loads the saves of the other
three of its precision into a model and optimizer pre-filled with a sentinel; comparisons are
``torch.equal``. Goldens (tests/helpers/layout_goldens.py, independent of the code under test):
the full logical tensor of each parameter holds ``k*1024 + row + col/256``; the fp32 main param
the same, ``momentum_buffer`` and ``exp_avg`` ``golden + 0.5``, ``exp_avg_sq`` ``golden * 2``,
Adam's ``step`` 7; a rank's piece is cut by plain slicing (TP chunk, GTP padding and shard, a
distributed optimizer's flat range).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from layout_goldens import SENTINEL, STEP, build, cut, diff, layout_goldens, make_cfg
from multiproc import reset_model_parallel, run_distributed
from optimizer_entries import main_param_entries

pytestmark = pytest.mark.multiprocess

WORLD = 4
_MUON = ("optim=muon",)
_BF16 = (*_MUON, "precision=bf16")
_DO = (*_BF16, "optim.use_distributed_optimizer=true")
# name: (tp, gtp_remat_size, pad_for_alignment, overrides)
LAYOUTS = {
    "tp1": (1, 1, None, _MUON),
    "tp2": (2, 1, None, _MUON),
    "g2a16": (1, 2, 16, _MUON),
    "tp2g2a32": (2, 2, 32, _MUON),
    "bf16": (1, 1, None, _BF16),
    "do": (1, 1, None, _DO),
    "g2a16do": (1, 2, 16, _DO),
    "tp2do": (2, 1, None, _DO),
}
# Each layout reads the three others of its precision.
PAIRS = [(src, dst) for group in (list(LAYOUTS)[:4], list(LAYOUTS)[4:])
         for dst in group for src in group if src != dst]


def _state(opt, main) -> tuple:
    """(kind, [(name, state tensor, golden index)]) of one param: Muon's momentum buffer, or
    Adam's moments (golden index 1: ``golden + 0.5``; 2: ``golden * 2``)."""
    st = opt.state[main]
    if "momentum_buffer" in st:
        return "muon", [("momentum_buffer", st["momentum_buffer"], 1)]
    return "adam", [("exp_avg", st["exp_avg"], 1), ("exp_avg_sq", st["exp_avg_sq"], 2)]


@torch.no_grad()
def _fill(model, optimizer, cfg, sentinel: bool) -> dict:
    gold = layout_goldens(model, cfg)
    for p, _, (want, _, _) in gold.values():
        p.copy_(torch.full_like(p, SENTINEL) if sentinel else want)
    kinds = {"muon": 0, "adam": 0}
    for opt, p, main, sl in main_param_entries(optimizer):
        goldens = gold[id(p)][2]
        kind, tensors = _state(opt, main)
        for dst, i in [(main, 0)] + [(t, i) for _, t, i in tensors]:
            dst.copy_(torch.full_like(dst, SENTINEL) if sentinel else cut(goldens[i], sl))
        if kind == "adam":
            opt.state[main]["step"] = torch.tensor(SENTINEL if sentinel else STEP)
        kinds[kind] += 1
    return kinds


@torch.no_grad()
def _check(model, optimizer, cfg) -> list:
    gold = layout_goldens(model, cfg)
    problems = [diff(f"{name} weight", p.detach(), want.to(p.dtype))
                for p, name, (want, _, _) in gold.values()]
    steps = {}
    for opt, p, main, sl in main_param_entries(optimizer):
        _, name, goldens = gold[id(p)]
        kind, tensors = _state(opt, main)
        problems.append(diff(f"{name} fp32 main param", main.detach(), cut(goldens[0], sl)))
        problems += [diff(f"{name} {what}", t, cut(goldens[i], sl)) for what, t, i in tensors]
        st = opt.state[main]
        if kind == "muon":
            problems.append(f"{name}: a Muon state with a step" if "step" in st else None)
            continue
        problems.append(None if float(st["step"]) == STEP else f"{name} step {float(st['step'])}")
        steps.setdefault(id(opt), []).append(id(st["step"]))
    for ids in steps.values():  # a shared step tensor advances once per param per step
        if len(set(ids)) != len(ids):
            problems.append(f"{len(ids) - len(set(ids))} params share a step tensor")
    return [x for x in problems if x]


def _worker(root: str, cfgs: dict, pairs: list) -> dict:
    from omegaconf import OmegaConf

    from ckpt import io as checkpoint

    out = {"filled": {}, "loads": {}}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        out["filled"][name] = _fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0,
                                    "config": OmegaConf.to_container(cfg, resolve=True)}, record)
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        for src in [s for s, d in pairs if d == name]:
            _fill(model, opt, cfg, sentinel=True)
            checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
            out["loads"][(src, name)] = _check(model, opt, cfg)
    reset_model_parallel()
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_layouts")
    cfgs = {name: make_cfg("tiny_swiglu", tp, g, pad, WORLD, "logical", *extra)
            for name, (tp, g, pad, extra) in LAYOUTS.items()}
    t0 = time.time()
    results = run_distributed(_worker, WORLD, str(root), cfgs, PAIRS, timeout=1200)
    print(f"\nMuon matrix: {time.time() - t0:.0f}s")
    return results


def test_each_layout_reads_three_others_of_its_precision():
    for name in LAYOUTS:
        assert sum(dst == name for _, dst in PAIRS) == 3, name
        assert sum(src == name for src, _ in PAIRS) == 3, name


def test_muon_layout_pairs_restore_every_tensor_exactly(matrix):
    failed = [(rank, pair, problems[:4]) for rank, res in enumerate(matrix)
              for pair, problems in sorted(res["loads"].items()) if problems]
    assert not failed, failed
    assert all(set(res["loads"]) == set(PAIRS) for res in matrix)
    # Every rank held Muon and Adam state at every layout (the layer-wise optimizer gives each
    # Muon weight to one data-parallel rank: summed over the ranks, all of them).
    for name in LAYOUTS:
        assert sum(res["filled"][name]["adam"] for res in matrix) > 0, name
        assert sum(res["filled"][name]["muon"] for res in matrix) > 0, name
