"""The checkpoint layout matrix: ckpt/format/logical_format.py across every layout pair, on CPU.

Run once a session (the ``checkpoint_matrix`` fixture of tests/conftest.py) and read by
tests/test_checkpoint_layouts.py and tests/test_checkpoint_bad_input.py.

One 4-process gloo world hosts every layout in turn (megatron's process groups are rebuilt for
each; the data-parallel size fills the rest: tp1 alone runs as dp4, tp2 x g2 as dp1). Each layout
of {gtp off, tp2, g2/a16, g4/a32, tp2 x g2/a16, g2/a1} builds the tiny SwiGLU GPT through
``recipes.run.worker.setup`` (the recipe's own model, DDP, megatron optimizer and scheduler), sets
every weight and Adam moment to a golden, and saves through ``ckpt.io``; then each
layout loads every checkpoint into a model pre-filled with a sentinel and compares.

The goldens are built independently of the code under test: each parameter's *full logical*
tensor holds ``k*1024 + row + col/256`` (``k``: the parameter's index in sorted name order; 23
significant bits, exact in fp32), ``exp_avg = golden + 0.5``, ``exp_avg_sq = golden * 2``,
``step = 7``. A rank's expected local tensor is cut from the full one by plain slicing: TP chunk
(gated fc1: gate rows then up rows of the TP rank, the file order ``[W; V]``), then megatron's GTP
tail padding with zeros and the rank's ``shard``-row slice. Comparisons are exact (torch.equal),
padding rows included (they must come back zero).

Dims (hidden 72, ffn 200, SwiGLU fc1 400 rows, vocab 257 -> 320) make the padded branches run:
g4/a32 leaves GTP rank 3 of linear_proj/linear_fc2 (L=72 -> 32,32,8,0) with only padding, and the
gated fc1 shards straddle the gate/up boundary (g4/a32: L=400 -> 128,128,128,16; tp2 x g2/a16:
L=200 -> 112,88).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from layout_goldens import (
    SENTINEL, STEP, build as _build, diff as _diff, full_shape as _full_shape, gated as _gated,
    golden_full as _golden_full, is_gtp as _is_gtp, local as _local, make_cfg,
    fill as _pp_fill, check as _pp_check,
)
from multiproc import run_distributed
from optimizer_entries import opt_states

WORLD = 4
# name: (tp, g, pad_for_alignment)
LAYOUTS = {
    "off": (1, 1, None),
    "tp2": (2, 1, None),
    "g2a16": (1, 2, 16),
    "g4a32": (1, 4, 32),
    "tp2g2a16": (2, 2, 16),
    "g2a1": (1, 2, 1),
}
# llama_tiny: 6 query heads of 12 channels in 2 K/V groups (QKV rows (6 + 2*2) * 12 = 120, 60
# per TP rank at tp2: one whole group each; a16 pads 60 to 64 and 120 to 128, so GTP shards cut
# through a group's query and K/V rows), SwiGLU fc1 400 rows.
# tp2 x g2/a64 pads QKV's 60 rows per TP rank to 128: GTP rank 1 holds only padding on both TP
# ranks, so two ranks have an empty piece at one offset (written once: test_every_save_verifies).
LLAMA_LAYOUTS = {**{name: LAYOUTS[name] for name in ("off", "tp2", "g2a16", "tp2g2a16")},
                 "tp2g2a64": (2, 2, 64)}


# The pipeline / distributed-optimizer matrix (bf16): name -> (model, tp, g, pad, extra
# overrides); data-parallel size = 4 / (tp * pp * g). (Tied embeddings under PP: the e2e tests.)
_BF16 = ("precision=bf16",)
_DISTOPT = ("optim.use_distributed_optimizer=true",)
PP_LAYOUTS = {
    "tp1": ("tiny_swiglu", 1, 1, None, _BF16),
    "pp2": ("tiny_swiglu", 1, 1, None, (*_BF16, "parallelism.pipeline_model_parallel_size=2")),
    "tp2pp2": ("tiny_swiglu", 2, 1, None,
               (*_BF16, "parallelism.pipeline_model_parallel_size=2")),
    "pp2g2a16": ("tiny_swiglu", 1, 2, 16,
                 (*_BF16, "parallelism.pipeline_model_parallel_size=2")),
    "pp2dp2do": ("tiny_swiglu", 1, 1, None,
                 (*_BF16, *_DISTOPT, "parallelism.pipeline_model_parallel_size=2")),
    "g2a16dp2do": ("tiny_swiglu", 1, 2, 16, (*_BF16, *_DISTOPT)),
}
# Virtual pipeline stages (4 layers: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3),
# saved and loaded among themselves and a pp1 layout of the same model.
_L4 = (*_BF16, "model.num_layers=4")
_PP2V2 = ("parallelism.pipeline_model_parallel_size=2",
          "parallelism.virtual_pipeline_model_parallel_size=2")
VPP_LAYOUTS = {
    "l4_tp1": ("tiny_swiglu", 1, 1, None, _L4),
    "l4_pp2v2dp2do": ("tiny_swiglu", 1, 1, None, (*_L4, *_DISTOPT, *_PP2V2)),
    "l4_pp2v2g2a16": ("tiny_swiglu", 1, 2, 16, (*_L4, *_PP2V2)),
}


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def goldens(model, cfg, real_vocab: int | None = None) -> dict:
    """{name: (param, expected param, expected exp_avg, expected exp_avg_sq)} on this rank.

    ``real_vocab``: expect zeros in the vocabulary rows from ``real_vocab`` on (a load from a
    checkpoint of another padded vocabulary size reads only the real rows)."""
    named = sorted(model.module.named_parameters())
    out = {}
    for k, (name, p) in enumerate(named, start=1):
        full = _golden_full(k, _full_shape(p))
        fulls = [full, full + 0.5, full * 2]
        if real_vocab is not None and name in VOCAB_ROWS:
            for f in fulls:
                f[real_vocab:] = 0
        out[name] = (p, *(_local(f, p, name, cfg) for f in fulls))
    return out


@torch.no_grad()
def set_golden(model, optimizer, cfg) -> dict:
    """Fill weights and Adam state with the goldens; returns coverage counts for this rank."""
    gold = goldens(model, cfg)
    by_id = {id(v[0]): v for v in gold.values()}
    for p, want, _, _ in gold.values():
        p.copy_(want)
    for opt, p in opt_states(optimizer):
        _, _, m, v = by_id[id(p)]
        opt.state[p]["exp_avg"].copy_(m)
        opt.state[p]["exp_avg_sq"].copy_(v)
        opt.state[p]["step"] = torch.tensor(STEP)
    counts = {"gtp": 0, "padded": 0, "empty": 0, "straddle": 0}
    for name, (p, _, _, _) in gold.items():
        if not _is_gtp(p):
            continue
        L, s, r = p._unsharded_shape[0], p.shape[0], p.group.rank()
        lo, hi = min(r * s, L), min((r + 1) * s, L)
        counts["gtp"] += 1
        counts["padded"] += p.pad_length > 0
        counts["empty"] += lo == hi
        counts["straddle"] += _gated(name, cfg) and lo < L // 2 < hi
    return counts


@torch.no_grad()
def fill_sentinel(model, optimizer) -> None:
    for p in model.parameters():
        p.fill_(SENTINEL)
    for opt, p in opt_states(optimizer):
        opt.state[p]["exp_avg"].fill_(SENTINEL)
        opt.state[p]["exp_avg_sq"].fill_(SENTINEL)
        opt.state[p]["step"] = torch.tensor(SENTINEL)


@torch.no_grad()
def check_goldens(model, optimizer, cfg, real_vocab: int | None = None) -> tuple[int, list[str]]:
    """(tensors compared, problems) of weights, exp_avg, exp_avg_sq and step vs the goldens."""
    gold = goldens(model, cfg, real_vocab)
    names = {id(v[0]): n for n, v in gold.items()}
    problems, n = [], 0
    for name, (p, want, _, _) in gold.items():
        problems.append(_diff(f"{name} weight", p.detach(), want))
        n += 1
    for opt, p in opt_states(optimizer):
        name = names[id(p)]
        _, _, m, v = gold[name]
        st = opt.state[p]
        problems.append(_diff(f"{name} exp_avg", st["exp_avg"], m))
        problems.append(_diff(f"{name} exp_avg_sq", st["exp_avg_sq"], v))
        if float(st["step"]) != STEP:
            problems.append(f"{name} step {float(st['step'])}")
        n += 3
    return n, [x for x in problems if x]


def decode_rows(t: torch.Tensor, k: int) -> list[int | None]:
    """The full-tensor row index each local row holds (golden ``k``), None for zeros/garbage."""
    out = []
    for v in t[:, 0].tolist():
        row = v - k * 1024
        out.append(int(row) if v != 0 and row == int(row) and 0 <= row < 1024 else None)
    return out


def row_runs(rows: list) -> list:
    """[(first, last) runs of consecutive rows, or (None, count) of unknown rows]."""
    runs = []
    for r in rows:
        if runs and r is not None and runs[-1][0] is not None and runs[-1][1] + 1 == r:
            runs[-1] = (runs[-1][0], r)
        elif runs and r is None and runs[-1][0] is None:
            runs[-1] = (None, runs[-1][1] + 1)
        else:
            runs.append((r, r) if r is not None else (None, 1))
    return runs


def fc1_rows(model, cfg) -> dict:
    """Rows (decoded) the layer-0 fc1 weight shard and its exp_avg hold on this rank."""
    from megatron.core import parallel_state as ps

    named = sorted(model.module.named_parameters())
    k, (name, p) = next((k, np_) for k, np_ in enumerate(named, start=1)
                        if np_[0] == "decoder.layers.0.mlp.linear_fc1.weight")
    g = p.group if _is_gtp(p) else None
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "gtp_rank": g.rank() if g is not None else 0,
        "L": p._unsharded_shape[0] if g is not None else p.shape[0],
        "pad": getattr(p, "pad_length", 0),
        "rows": row_runs(decode_rows(p.detach(), k)),
    }


def shape_problems(model, cfg, record) -> list[str]:
    """Differences between the built model's parameters on this rank and ``recipes.model.shapes``."""
    from recipes.model.shapes import padded_vocab_size
    from recipes.families import parameter_shapes
    from recipes.model.shapes import local_shape

    tp, g = record["tensor_model_parallel_size"], record["gtp_remat_size"]
    padded = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by, tp)
    want = {p.name: local_shape(p, tp, g, record["pad_for_alignment"])[0]
            for p in parameter_shapes(cfg.model, padded)}
    got = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    return [f"{n}: built {got.get(n)}, table {want.get(n)}" for n in sorted(got.keys() | want.keys())
            if got.get(n) != want.get(n)]


def save_and_load_all(root: Path, cfgs: dict, prefix: str, out: dict) -> None:
    """Save every layout of ``cfgs`` (goldens), then load each checkpoint at every layout."""
    from ckpt import io as checkpoint

    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        out["shapes"][name] = shape_problems(model, cfg, record)
        out["coverage"][name] = set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / f"{prefix}{name}", 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            fill_sentinel(model, opt)
            checkpoint.load_checkpoint(root / f"{prefix}{src}", model, opt, sched, record)
            out["loads"][(src, name)] = check_goldens(model, opt, cfg)


def matrix_worker(root: str, cfgs: dict, plain: dict, llama: dict,
                   pp_cfgs: dict | None = None, vpp_cfgs: dict | None = None) -> dict:
    """Save every layout, load every checkpoint at every layout; plus the asymmetric case, the
    Llama-style model's layouts, then the pipeline / distributed-optimizer matrix
    (:func:`pp_phase`) and the virtual-pipeline pairs in the same world."""
    from megatron.core import dist_checkpointing, parallel_state

    from ckpt.format import logical_format
    from ckpt import io as checkpoint

    assert torch.distributed.get_world_size() == WORLD
    root = Path(root)
    out = {"coverage": {}, "loads": {}, "metadata": {}, "timing": {}}
    t0 = time.time()
    out["shapes"] = {}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        assert logical_format.is_installed()
        out["shapes"][name] = shape_problems(model, cfg, record)
        out["coverage"][name] = set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / name, 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
    out["timing"]["save"] = time.time() - t0

    t0 = time.time()
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            fill_sentinel(model, opt)
            common = checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            out["loads"][(src, name)] = check_goldens(model, opt, cfg)
            if name == "off":
                out["metadata"][src] = common.get(logical_format.SHARDING_RECORD_KEY)
    out["timing"]["load"] = time.time() - t0

    # The file of every layout holds the same full tensors as the non-GTP one (same goldens).
    t0 = time.time()
    ref = dist_checkpointing.load_plain_tensors(str(root / "off" / "iter_0000001"))
    ref = {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}
    disk = {}
    for name in cfgs:
        got = dist_checkpointing.load_plain_tensors(str(root / name / "iter_0000001"))
        got = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
        problems = [] if got.keys() == ref.keys() else [f"keys differ: {sorted(got.keys() ^ ref.keys())[:5]}"]
        problems += [p for k in sorted(got.keys() & ref.keys())
                     if (p := _diff(k, got[k], ref[k]))]
        disk[name] = (len(got), problems)
    out["disk"] = disk
    out["timing"]["disk"] = time.time() - t0

    # The asymmetric case: a plain (non-SwiGLU) tp2 checkpoint read into tp2 x g2/a16.
    t0 = time.time()
    model, opt, sched, record, cfg = _build(plain["tp2"])
    set_golden(model, opt, cfg)
    checkpoint.save_checkpoint(root / "plain_tp2", 1, model, opt, sched, {"consumed_samples": 0},
                               record)
    model, opt, sched, record, cfg = _build(plain["tp2g2a16"])
    asym = {}
    for mode in ("stock", "logical"):
        logical_format.configure(mode)
        fill_sentinel(model, opt)
        checkpoint.load_checkpoint(root / "plain_tp2", model, opt, sched, record)
        asym[mode] = {"check": check_goldens(model, opt, cfg), "fc1": fc1_rows(model, cfg)}
    out["asym"] = asym
    # What a stock-format save records about itself.
    logical_format.configure("stock")
    checkpoint.save_checkpoint(root / "plain_tp2g2a16_stock", 1, model, opt, sched, {}, record)
    logical_format.configure("logical")
    out["stock_metadata"] = dist_checkpointing.load_common_state_dict(
        str(root / "plain_tp2g2a16_stock" / "iter_0000001"))[logical_format.SHARDING_RECORD_KEY]
    out["timing"]["asym"] = time.time() - t0

    # A Llama-style model (GQA QKV, SwiGLU fc1, RMSNorm, no biases) across its layouts.
    t0 = time.time()
    out["llama"] = {"shapes": {}, "coverage": {}, "loads": {}}
    save_and_load_all(root, llama, "llama_", out["llama"])
    out["timing"]["llama"] = time.time() - t0
    if pp_cfgs:
        t0 = time.time()
        out["pp"] = pp_phase(root / "pp", pp_cfgs)
        out["timing"]["pp"] = time.time() - t0
    if vpp_cfgs:
        t0 = time.time()
        out["vpp"] = pp_pairs(root / "vpp", vpp_cfgs, {"loads": {}, "filled": {}, "records": {}})
        out["timing"]["vpp"] = time.time() - t0
    parallel_state.destroy_model_parallel()
    return out


def pp_phase(root: Path, cfgs: dict) -> dict:
    out = {"loads": {}, "filled": {}, "records": {}}
    out["negative"] = pp_negative_controls(root, cfgs)
    return pp_pairs(root, cfgs, out)


def pp_pairs(root: Path, cfgs: dict, out: dict) -> dict:
    """Save each layout of ``cfgs`` filled with the goldens; load each at each (sentinel first)."""
    from ckpt import io as checkpoint

    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        out["filled"][name] = _pp_fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(root / name, 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
        out["records"][name] = record
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            _pp_fill(model, opt, cfg, sentinel=True)
            checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            out["loads"][(src, name)] = _pp_check(model, opt, cfg)
    return out


def pp_negative_controls(root: Path, cfgs: dict) -> dict:
    """The checks above must catch (1) a layer loaded at the wrong pipeline offset (stage 1 of
    pp2 reading layer 0 instead of layer 1: megatron's sharded keys follow ``layer_number``)
    and (2) a distributed-optimizer bucket whose state a save lost."""
    from megatron.core import parallel_state as ps

    from ckpt import io as checkpoint
    from ckpt.io import CheckpointError

    out = {}
    # (1) tp1 checkpoint -> pp2 model whose last stage numbers its layers from 0.
    model, opt, sched, record, cfg = _build(cfgs["tp1"])
    _pp_fill(model, opt, cfg, sentinel=False)
    checkpoint.save_checkpoint(root / "neg_tp1", 1, model, opt, sched, {}, record)
    model, opt, sched, record, cfg = _build(cfgs["pp2"])
    _pp_fill(model, opt, cfg, sentinel=True)
    layers = model.module.module.decoder.layers
    shift = ps.get_pipeline_model_parallel_rank() * len(layers)
    for layer in layers:
        layer.layer_number -= shift
    try:
        checkpoint.load_checkpoint(root / "neg_tp1", model, opt, sched, record)
        out["wrong_offset"] = {"error": None, "problems": _pp_check(model, opt, cfg)[1]}
    except CheckpointError as exc:
        out["wrong_offset"] = {"error": str(exc), "problems": _pp_check(model, opt, cfg)[1]}
    finally:
        for layer in layers:
            layer.layer_number += shift
    # (2) distributed optimizer (pp2 x dp2): the first bucket's state is lost in the save
    # (written as zeros: megatron's save validation refuses a save that omits the keys).
    model, opt, sched, record, cfg = _build(cfgs["pp2dp2do"])
    _pp_fill(model, opt, cfg, sentinel=False)
    (dist,) = opt.chained_optimizers
    first_bucket = list(dist.gbuf_ranges[0].values())[0][0]["param_map"]
    original = dist.sharded_state_dict

    def losing_first_bucket(model_sd, is_loading=False, **kwargs):
        sd = original(model_sd, is_loading, **kwargs)
        order = [p for i in range(len(dist.gbuf_ranges)) for p in dist.buffers[i].param_index_map]
        for idx, p in enumerate(order):
            if p in first_bucket:
                for entry in sd["param_state"][idx].values():
                    entry.data.zero_()
        return sd

    dist.sharded_state_dict = losing_first_bucket
    try:
        checkpoint.save_checkpoint(root / "neg_dropped", 1, model, opt, sched, {}, record)
    finally:
        dist.sharded_state_dict = original
    _pp_fill(model, opt, cfg, sentinel=True)
    checkpoint.load_checkpoint(root / "neg_dropped", model, opt, sched, record)
    out["dropped_bucket"] = _pp_check(model, opt, cfg)[1]
    return out


# --------------------------------------------------------------------------------------------


def run(root: Path) -> tuple[Path, list]:
    """Run the matrix (:func:`matrix_worker`) in one ``WORLD``-process gloo world under ``root``.

    Returns:
        ``(root, results)``: ``results[rank]`` is that rank's :func:`matrix_worker` dict.
    """
    cfgs = {name: make_cfg("tiny_swiglu", tp, g, pad, WORLD) for name, (tp, g, pad) in LAYOUTS.items()}
    plain = {"tp2": make_cfg("tiny", 2, 1, None, WORLD),
             "tp2g2a16": make_cfg("tiny", 2, 2, 16, WORLD)}
    llama = {name: make_cfg("llama_tiny", *lay, WORLD) for name, lay in LLAMA_LAYOUTS.items()}
    pp_cfgs = {name: make_cfg(model, tp, g, pad, WORLD, "logical", *extra)
               for name, (model, tp, g, pad, extra) in PP_LAYOUTS.items()}
    t0 = time.time()
    vpp_cfgs = {name: make_cfg(model, tp, g, pad, WORLD, "logical", *extra)
                for name, (model, tp, g, pad, extra) in VPP_LAYOUTS.items()}
    results = run_distributed(matrix_worker, WORLD, str(root), cfgs, plain, llama, pp_cfgs,
                              vpp_cfgs,
                              timeout=1200)
    assert len(results) == WORLD
    print(f"\nmatrix run: {time.time() - t0:.0f}s, rank 0 phases {results[0]['timing']}")
    return root, results
