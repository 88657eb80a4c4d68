"""ckpt/format/logical_format.py: the logical checkpoint format, across every layout pair, on CPU.

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

import pytest
import torch

from layout_goldens import (
    SENTINEL, STEP, build as _build, diff as _diff, full_shape as _full_shape, gated as _gated,
    golden_full as _golden_full, is_gtp as _is_gtp, local as _local, make_cfg,
    fill as _pp_fill, check as _pp_check,
)
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

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


def _goldens(model, cfg, real_vocab: int | None = None) -> dict:
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


def _opt_states(optimizer):
    """(torch optimizer, param) for every param of megatron's (chained) optimizer."""
    for co in getattr(optimizer, "chained_optimizers", [optimizer]):
        co.init_state_fn(co.optimizer, co.config)
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                yield co.optimizer, p


@torch.no_grad()
def _set_golden(model, optimizer, cfg) -> dict:
    """Fill weights and Adam state with the goldens; returns coverage counts for this rank."""
    gold = _goldens(model, cfg)
    by_id = {id(v[0]): v for v in gold.values()}
    for p, want, _, _ in gold.values():
        p.copy_(want)
    for opt, p in _opt_states(optimizer):
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
def _fill_sentinel(model, optimizer) -> None:
    for p in model.parameters():
        p.fill_(SENTINEL)
    for opt, p in _opt_states(optimizer):
        opt.state[p]["exp_avg"].fill_(SENTINEL)
        opt.state[p]["exp_avg_sq"].fill_(SENTINEL)
        opt.state[p]["step"] = torch.tensor(SENTINEL)


@torch.no_grad()
def _check(model, optimizer, cfg, real_vocab: int | None = None) -> tuple[int, list[str]]:
    """(tensors compared, problems) of weights, exp_avg, exp_avg_sq and step vs the goldens."""
    gold = _goldens(model, cfg, real_vocab)
    names = {id(v[0]): n for n, v in gold.items()}
    problems, n = [], 0
    for name, (p, want, _, _) in gold.items():
        problems.append(_diff(f"{name} weight", p.detach(), want))
        n += 1
    for opt, p in _opt_states(optimizer):
        name = names[id(p)]
        _, _, m, v = gold[name]
        st = opt.state[p]
        problems.append(_diff(f"{name} exp_avg", st["exp_avg"], m))
        problems.append(_diff(f"{name} exp_avg_sq", st["exp_avg_sq"], v))
        if float(st["step"]) != STEP:
            problems.append(f"{name} step {float(st['step'])}")
        n += 3
    return n, [x for x in problems if x]


def _decode_rows(t: torch.Tensor, k: int) -> list[int | None]:
    """The full-tensor row index each local row holds (golden ``k``), None for zeros/garbage."""
    out = []
    for v in t[:, 0].tolist():
        row = v - k * 1024
        out.append(int(row) if v != 0 and row == int(row) and 0 <= row < 1024 else None)
    return out


def _runs(rows: list) -> list:
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


def _fc1_rows(model, cfg) -> dict:
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
        "rows": _runs(_decode_rows(p.detach(), k)),
    }


def _shape_problems(model, cfg, record) -> list[str]:
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


def _save_and_load_all(root: Path, cfgs: dict, prefix: str, out: dict) -> None:
    """Save every layout of ``cfgs`` (goldens), then load each checkpoint at every layout."""
    from ckpt import io as checkpoint

    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        out["shapes"][name] = _shape_problems(model, cfg, record)
        out["coverage"][name] = _set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / f"{prefix}{name}", 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            _fill_sentinel(model, opt)
            checkpoint.load_checkpoint(root / f"{prefix}{src}", model, opt, sched, record)
            out["loads"][(src, name)] = _check(model, opt, cfg)


def _matrix_worker(root: str, cfgs: dict, plain: dict, llama: dict,
                   pp_cfgs: dict | None = None, vpp_cfgs: dict | None = None) -> dict:
    """Save every layout, load every checkpoint at every layout; plus the asymmetric case, the
    Llama-style model's layouts, then the pipeline / distributed-optimizer matrix
    (:func:`_pp_phase`) and the virtual-pipeline pairs in the same world."""
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
        out["shapes"][name] = _shape_problems(model, cfg, record)
        out["coverage"][name] = _set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / name, 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
    out["timing"]["save"] = time.time() - t0

    t0 = time.time()
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            _fill_sentinel(model, opt)
            common = checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            out["loads"][(src, name)] = _check(model, opt, cfg)
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
    _set_golden(model, opt, cfg)
    checkpoint.save_checkpoint(root / "plain_tp2", 1, model, opt, sched, {"consumed_samples": 0},
                               record)
    model, opt, sched, record, cfg = _build(plain["tp2g2a16"])
    asym = {}
    for mode in ("stock", "logical"):
        logical_format.configure(mode)
        _fill_sentinel(model, opt)
        checkpoint.load_checkpoint(root / "plain_tp2", model, opt, sched, record)
        asym[mode] = {"check": _check(model, opt, cfg), "fc1": _fc1_rows(model, cfg)}
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
    _save_and_load_all(root, llama, "llama_", out["llama"])
    out["timing"]["llama"] = time.time() - t0
    if pp_cfgs:
        t0 = time.time()
        out["pp"] = _pp_phase(root / "pp", pp_cfgs)
        out["timing"]["pp"] = time.time() - t0
    if vpp_cfgs:
        t0 = time.time()
        out["vpp"] = _pp_pairs(root / "vpp", vpp_cfgs, {"loads": {}, "filled": {}, "records": {}})
        out["timing"]["vpp"] = time.time() - t0
    parallel_state.destroy_model_parallel()
    return out


def _pp_phase(root: Path, cfgs: dict) -> dict:
    out = {"loads": {}, "filled": {}, "records": {}}
    out["negative"] = _pp_negative_controls(root, cfgs)
    return _pp_pairs(root, cfgs, out)


def _pp_pairs(root: Path, cfgs: dict, out: dict) -> dict:
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


def _pp_negative_controls(root: Path, cfgs: dict) -> dict:
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
# The matrix run (one 4-process world).
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    cfgs = {name: make_cfg("tiny_swiglu", tp, g, pad, WORLD) for name, (tp, g, pad) in LAYOUTS.items()}
    plain = {"tp2": make_cfg("tiny", 2, 1, None, WORLD),
             "tp2g2a16": make_cfg("tiny", 2, 2, 16, WORLD)}
    llama = {name: make_cfg("llama_tiny", *lay, WORLD) for name, lay in LLAMA_LAYOUTS.items()}
    pp_cfgs = {name: make_cfg(model, tp, g, pad, WORLD, "logical", *extra)
               for name, (model, tp, g, pad, extra) in PP_LAYOUTS.items()}
    t0 = time.time()
    vpp_cfgs = {name: make_cfg(model, tp, g, pad, WORLD, "logical", *extra)
                for name, (model, tp, g, pad, extra) in VPP_LAYOUTS.items()}
    results = run_distributed(_matrix_worker, WORLD, str(root), cfgs, plain, llama, pp_cfgs,
                              vpp_cfgs,
                              timeout=1200)
    assert len(results) == WORLD
    print(f"\nmatrix run: {time.time() - t0:.0f}s, rank 0 phases {results[0]['timing']}")
    return root, results


def test_every_layout_pair_restores_weights_and_moments_exactly(matrix):
    _, results = matrix
    n_pairs = 0
    for rank, res in enumerate(results):
        assert set(res["loads"]) == {(s, d) for s in LAYOUTS for d in LAYOUTS}
        for (src, dst), (n, problems) in sorted(res["loads"].items()):
            assert n > 50, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
            n_pairs += 1
    assert n_pairs == WORLD * len(LAYOUTS) ** 2


def test_llama_gqa_every_layout_pair_restores_exactly(matrix):
    """GQA QKV (query groups interleaved with K and V), SwiGLU fc1 and every other weight and
    Adam moment of llama_tiny, row by row (rtol=0), for every pair of
    {tp1, tp2, g2/a16, tp2 x g2/a16, tp2 x g2/a64}."""
    _, results = matrix
    for rank, res in enumerate(results):
        loads = res["llama"]["loads"]
        assert set(loads) == {(s, d) for s in LLAMA_LAYOUTS for d in LLAMA_LAYOUTS}
        for (src, dst), (n, problems) in sorted(loads.items()):
            assert n > 40, (src, dst, n)
            assert not problems, f"rank {rank}: llama {src} -> {dst}: {problems[:6]}"
    padded = sum(r["llama"]["coverage"]["tp2g2a16"]["padded"] for r in results)
    straddle = sum(r["llama"]["coverage"]["g2a16"]["straddle"] for r in results)
    assert padded > 0 and straddle > 0, (padded, straddle)


def test_every_save_verifies(matrix):
    """``gtp verify`` reads every byte of every checkpoint the matrix saved: each byte belongs to
    a record of .metadata (an all-padding shard's empty piece, at one offset on several ranks,
    is written by one of them) and every CRC holds."""
    from ckpt import verify

    root, _ = matrix
    iters = sorted(p for p in root.rglob("iter_*") if p.is_dir())
    assert len(iters) >= 13 and any("llama_tp2g2a64" in str(p) for p in iters)
    for path in iters:
        report = verify.verify_iteration(path)
        assert not report.problems, (str(path), [str(p) for p in report.problems[:4]])


def test_built_models_have_the_shapes_of_the_table(matrix):
    """recipes.model.shapes (used by the dry run and the pre-launch GTP checks) equals what megatron
    builds, per rank, for both models at every layout."""
    _, results = matrix
    for rank, res in enumerate(results):
        for name, problems in {**res["shapes"], **{f"llama {k}": v for k, v in
                                                    res["llama"]["shapes"].items()}}.items():
            assert not problems, (rank, name, problems[:5])


def test_padded_branches_ran(matrix):
    _, results = matrix
    total = {name: {k: sum(r["coverage"][name][k] for r in results) for k in
                    ("gtp", "padded", "empty", "straddle")} for name in LAYOUTS}
    assert total["off"]["gtp"] == total["tp2"]["gtp"] == 0
    for name in ("g2a16", "g4a32", "tp2g2a16", "g2a1"):
        assert total[name]["gtp"] > 0, (name, total[name])
    for name in ("g2a16", "g4a32", "tp2g2a16"):
        assert total[name]["padded"] > 0, (name, total[name])
    # g4/a32: GTP rank 3 of linear_proj / linear_fc2 (2 layers each) holds only padding.
    assert total["g4a32"]["empty"] == 4, total["g4a32"]
    # SwiGLU fc1 shards straddling gate and up (2 layers; summed over the 4 ranks, so DP
    # replicas count too): g4/a32 rank 1 (rows 128-256 of 400; dp1), tp2 x g2/a16 GTP rank 0
    # of each TP rank (rows 0-112 of 200; dp1), g2/a16 rank 0 (rows 0-224 of 400; dp2).
    assert total["g4a32"]["straddle"] == 2 and total["tp2g2a16"]["straddle"] == 4, total
    assert total["g2a16"]["straddle"] == 4, total


def test_file_of_every_layout_equals_the_non_gtp_file(matrix):
    """The logical format: a GTP checkpoint holds exactly what the non-GTP model writes."""
    _, results = matrix
    for name, (n, problems) in results[0]["disk"].items():
        assert n > 50 and not problems, (name, problems[:5])


def test_checkpoint_records_its_layout(matrix):
    _, results = matrix
    meta = results[0]["metadata"]
    for name, (tp, g, pad) in LAYOUTS.items():
        m = meta[name]
        assert m["gtp_format"] == "logical-v1", (name, m)
        assert (m["tp"], m["gtp_remat_size"], m["pad_for_alignment"]) == (tp, g, pad or 0), m
        assert m["megatron_core"] == "0.19.2"
        if g == 1:
            assert m["tensors"] == {}, m
            continue
        fc1 = m["tensors"]["decoder.layers.mlp.linear_fc1.weight"]
        assert fc1["gated"] and fc1["tp_axis"] == 0 and fc1["L"] == 400 // tp
        assert fc1["global_shape"] == [400, 72]
        assert fc1["params"] == [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in (0, 1)]
        proj = m["tensors"]["decoder.layers.self_attention.linear_proj.weight"]
        assert proj["tp_axis"] == 1 and proj["L"] == 72 and not proj["gated"]
        assert proj["global_shape"] == [72, 72]
        assert set(m["tensors"]) == {
            "embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.self_attention.linear_proj.weight",
            "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
        }
    assert meta["g4a32"]["tensors"]["decoder.layers.mlp.linear_fc2.weight"]["pad"] == 56
    assert meta["tp2g2a16"]["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["pad"] == 24


def test_stock_layout_checkpoint_says_so(matrix):
    """checkpoint_layout=stock: megatron 0.19.2's padded format, tagged for the stock reader."""
    _, results = matrix
    meta = results[0]["stock_metadata"]
    assert meta["gtp_format"] == "stock-0.19.2"
    assert (meta["tp"], meta["gtp_remat_size"], meta["pad_for_alignment"]) == (2, 2, 16)
    fc1 = meta["tensors"]["decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1["L"], fc1["pad"], fc1["shard_rows"], fc1["tp_axis"], fc1["gated"]) == (
        100, 28, 64, 0, False)
    proj = meta["tensors"]["decoder.layers.self_attention.linear_proj.weight"]
    assert (proj["L"], proj["pad"], proj["shard_rows"], proj["tp_axis"]) == (72, 24, 48, 1)
    assert proj["global_shape"] == [72, 72]


def test_asymmetric_load_discriminates_stock_from_logical(matrix):
    """tp2 (no GTP) checkpoint -> tp2 x g2/a16 model. fc1 (plain GELU MLP): TP-local L=100,
    pad 28, shard 64. Each row of the checkpoint holds its own index, so the rows a rank got
    can be read back. Stock 0.19.2 reads the rows of TP rank 1 shifted by the pad; gtp/ reads
    them exactly."""
    _, results = matrix
    fc1 = {(r["asym"]["stock"]["fc1"]["tp_rank"], r["asym"]["stock"]["fc1"]["gtp_rank"]):
           r["asym"] for r in results}
    assert sorted(fc1) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    lines = []
    for (tp_rank, gtp_rank), asym in sorted(fc1.items()):
        stock, logical = asym["stock"]["fc1"], asym["logical"]["fc1"]
        assert (stock["L"], stock["pad"]) == (100, 28)
        lo = tp_rank * 100 + min(gtp_rank * 64, 100)
        hi = tp_rank * 100 + min((gtp_rank + 1) * 64, 100)
        wanted = [(lo, hi - 1)] + ([(None, 64 - (hi - lo))] if hi - lo < 64 else [])
        lines.append(f"tp{tp_rank}/g{gtp_rank}: wants {wanted}, stock got {stock['rows']}, "
                     f"logical got {logical['rows']}")
        assert logical["rows"] == wanted, lines[-1]
    print("\n" + "\n".join(lines))
    # Stock 0.19.2 (spec section 3, measured): the loader's padded offsets put TP rank 1's
    # shards 28 rows (the pad) late, and GTP rank 1 of TP rank 0 reads TP rank 1's first rows
    # (zeros would be right there: they are padding).
    assert fc1[(0, 0)]["stock"]["fc1"]["rows"] == [(0, 63)]
    assert fc1[(0, 1)]["stock"]["fc1"]["rows"] == [(64, 127)]
    assert fc1[(1, 0)]["stock"]["fc1"]["rows"] == [(128, 191)]
    assert fc1[(1, 1)]["stock"]["fc1"]["rows"] == [(192, 199), (None, 56)]
    # So the full check fails on stock (weights and moments alike, on the ranks of TP rank 1
    # and on GTP rank 1 of TP rank 0) and passes everywhere with gtp/.
    stock_problems = [p for r in results for p in r["asym"]["stock"]["check"][1]]
    print("stock: " + "\n       ".join(stock_problems[:8]))
    for what in ("linear_fc1.weight weight", "linear_fc1.weight exp_avg",
                 "linear_fc1.weight exp_avg_sq", "linear_qkv.weight weight"):
        assert any(f"decoder.layers.0.mlp.{what}" in p or f"self_attention.{what}" in p
                   for p in stock_problems), what
    for rank, r in enumerate(results):
        n, problems = r["asym"]["logical"]["check"]
        assert n > 50 and not problems, (rank, problems[:5])


# --------------------------------------------------------------------------------------------
# Stock megatron-core (no gtp/ patch, no GTP backend) reads our GTP checkpoints.
# --------------------------------------------------------------------------------------------
STOCK_WORLD = 2


def _stock_reader_worker(root: str, cfgs: dict, sources: list) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gtp_api

    from gtp import backend
    from ckpt.format import logical_format
    from ckpt import io as checkpoint

    assert torch.distributed.get_world_size() == STOCK_WORLD
    out = {}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        # Nothing of gtp/ is active: megatron-core 0.19.2 as shipped (CPU redirects aside).
        assert not logical_format.is_installed() and not backend.is_installed()
        assert not gtp_api.HAVE_GTP
        for src in sources:
            _fill_sentinel(model, opt)
            checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
            out[(src, name)] = _check(model, opt, cfg)
    parallel_state.destroy_model_parallel()
    return out


def test_stock_megatron_loads_gtp_checkpoints_into_non_gtp_models(matrix):
    root, _ = matrix
    cfgs = {name: make_cfg("tiny_swiglu", tp, 1, None, STOCK_WORLD, "stock")
            for name, tp in (("tp1", 1), ("tp2", 2))}
    sources = ["g2a16", "g4a32", "tp2g2a16", "g2a1"]
    results = run_distributed(_stock_reader_worker, STOCK_WORLD, str(root), cfgs, sources,
                              timeout=600)
    for rank, res in enumerate(results):
        assert len(res) == len(sources) * len(cfgs)
        for (src, dst), (n, problems) in sorted(res.items()):
            assert n > 50 and not problems, f"rank {rank}: {src} -> stock {dst}: {problems[:5]}"


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the tensor or file, and nothing loaded.
# --------------------------------------------------------------------------------------------
def _untouched(model, optimizer) -> list[str]:
    """Names of weights / moments that no longer hold the sentinel everywhere."""
    bad = [n for n, p in model.module.named_parameters() if not bool((p == SENTINEL).all())]
    for opt, p in _opt_states(optimizer):
        st = opt.state[p]
        if not (bool((st["exp_avg"] == SENTINEL).all()) and float(st["step"]) == SENTINEL):
            bad.append(f"moment of {tuple(p.shape)}")
    return bad


def _bad_input_worker(root: str, good: str, cfgs: dict) -> dict:
    import shutil

    from megatron.core import parallel_state

    from ckpt import io as checkpoint
    from ckpt.io import CheckpointError

    assert torch.distributed.get_world_size() == STOCK_WORLD
    root, rank = Path(root), torch.distributed.get_rank()

    # Bad checkpoints, each written at g2/a16 (2 ranks) or derived from a good one.
    # wide: hidden 80 instead of 72; vocab: 384 vocab rows instead of 320 (only the padding
    # differs: loads); other_vocab: a 300-token tokenizer (also 320 rows: only the record differs).
    for case in ("wide", "vocab", "other_vocab"):
        model, opt, sched, record, cfg = _build(cfgs[case])
        _set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / case, 1, model, opt, sched, {}, record)
    model, opt, sched, record, cfg = _build(cfgs["g2a16"])
    checkpoint.save_checkpoint(root / "no_moments", 1, model, opt, sched, {}, record)  # fresh Adam
    _set_golden(model, opt, cfg)
    for co in opt.chained_optimizers:  # the output layer's moments missing
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                if p is model.module.output_layer.weight:
                    co.optimizer.state[p].clear()
    checkpoint.save_checkpoint(root / "fewer_moments", 1, model, opt, sched, {}, record)
    if rank == 0:
        shutil.copytree(good, root / "truncated")
        data = root / "truncated" / "iter_0000001" / "__1_0.distcp"
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    torch.distributed.barrier()

    out = {}
    for case in ("wide", "other_vocab", "no_moments", "fewer_moments", "truncated"):
        _fill_sentinel(model, opt)
        try:
            checkpoint.load_checkpoint(root / case, model, opt, sched, record)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        out[case] = {"error": error, "changed": _untouched(model, opt)}
    # And the good one still loads (the failures left nothing behind), unpickling its
    # .metadata once for the whole load (ckpt.format.safe_metadata.reused).
    from ckpt.format import safe_metadata

    _fill_sentinel(model, opt)
    unpickle, count = safe_metadata._RestrictedUnpickler.load, [0]

    def counted(self):
        count[0] += 1
        return unpickle(self)

    safe_metadata._RestrictedUnpickler.load = counted
    try:
        checkpoint.load_checkpoint(Path(good), model, opt, sched, record)
    finally:
        safe_metadata._RestrictedUnpickler.load = unpickle
    out["good"] = _check(model, opt, cfg)
    out["metadata_unpicklings"] = count[0]

    # Another padded vocabulary size: 258 rows (tp1, make_vocab_size_divisible_by=3, no GTP)
    # and 384 rows (g2/a16, 128) into 320-row models with and without GTP. The saved padding
    # rows hold goldens too, so a load that read them would show.
    model, opt, sched, record, cfg = _build(cfgs["div3"])
    _set_golden(model, opt, cfg)
    checkpoint.save_checkpoint(root / "div3", 1, model, opt, sched, {}, record)
    out["padding"] = {}
    for target in ("g2a16", "tp2"):
        model, opt, sched, record, cfg = _build(cfgs[target])
        for src in ("div3", "vocab"):
            _fill_sentinel(model, opt)
            try:
                checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            except checkpoint.CheckpointError as exc:
                out["padding"][(src, target)] = (0, [f"load refused: {exc}"])
                continue
            out["padding"][(src, target)] = _check(model, opt, cfg, real_vocab=257)
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def bad_inputs(matrix, tmp_path_factory):
    root, _ = matrix
    # Another tokenizer's model (300 tokens): only built, never fed, but its data paths are
    # checked before launch, so they name (empty) files that exist.
    fake = tmp_path_factory.mktemp("indexed") / "corpus"
    for suffix in (".bin", ".idx"):
        fake.with_suffix(suffix).touch()
    cfgs = {"g2a16": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD),
            "wide": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                             "model.hidden_size=80"),
            "vocab": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                              "model.make_vocab_size_divisible_by=128"),
            "other_vocab": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                                    "data=indexed", f"data.paths=[{fake}]", "data.vocab_size=300",
                                    "data.eod_id=299"),
            "div3": make_cfg("tiny_swiglu", 1, 1, None, STOCK_WORLD, "logical",
                             "model.make_vocab_size_divisible_by=3"),
            "tp2": make_cfg("tiny_swiglu", 2, 1, None, STOCK_WORLD)}
    out_root = tmp_path_factory.mktemp("bad")
    results = run_distributed(_bad_input_worker, STOCK_WORLD, str(out_root),
                              str(root / "g2a16"), cfgs, timeout=600)
    return out_root, results


def _errors(results, case):
    errors = [r[case]["error"] for r in results]
    for rank, r in enumerate(results):
        assert r[case]["error"], f"rank {rank}: loading {case} did not fail"
        assert not r[case]["changed"], f"rank {rank}: {case}: changed {r[case]['changed'][:5]}"
    return errors


def test_other_model_shape_is_refused_naming_the_tensor(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "wide"):
        assert "differently shaped model" in err or "Global shape mismatch" in err, err
        assert "(2, 80)" in err and "(2, 72)" in err, err


def test_other_real_vocabulary_is_refused_naming_both_sizes(bad_inputs):
    """A checkpoint of a 300-token tokenizer into a 257-token run: the same padded shapes (320
    rows), refused from the recorded real vocabulary before any tensor is read."""
    _, results = bad_inputs
    for err in _errors(results, "other_vocab"):
        assert "vocabulary of 300 tokens" in err and "has 257" in err, err


def test_other_padded_vocabulary_loads_the_real_rows_exactly(bad_inputs):
    """258 -> 320 rows (tp1 -> tp2, no GTP; tp1 -> g2/a16) and 384 -> 320 rows (g2/a16 ->
    g2/a16, tp2): weights and Adam moments of the 257 real rows exact, padding rows zero."""
    _, results = bad_inputs
    for rank, r in enumerate(results):
        assert set(r["padding"]) == {(s, d) for s in ("div3", "vocab") for d in ("g2a16", "tp2")}
        for pair, (n, problems) in sorted(r["padding"].items()):
            assert n > 50 and not problems, (rank, pair, problems[:5])


def test_truncated_tensor_file_is_refused_naming_it(bad_inputs):
    root, results = bad_inputs
    for err in _errors(results, "truncated"):
        assert "__1_0.distcp" in err and "truncated" in err, err


def test_truncated_file_is_caught_before_launch(bad_inputs):
    from ckpt.io import CheckpointError, check_loadable

    root, _ = bad_inputs
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp has \d+ bytes.*tensor '"):
        check_loadable(root / "truncated")


def test_checkpoint_without_optimizer_state_is_refused(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "no_moments"):
        assert "lacks tensors" in err and "optimizer.state.exp_avg." in err, err


def test_checkpoint_with_another_optimizer_param_set_is_refused(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "fewer_moments"):
        assert "lacks tensors" in err, err
        assert "optimizer.state.exp_avg.output_layer.weight" in err, err
        assert "optimizer.state.exp_avg.embedding" not in err, err


def test_good_checkpoint_loads_after_the_failures(bad_inputs):
    _, results = bad_inputs
    for rank, r in enumerate(results):
        n, problems = r["good"]
        assert n > 50 and not problems, (rank, problems[:5])


def test_a_load_unpickles_the_metadata_once(bad_inputs):
    _, results = bad_inputs
    assert [r["metadata_unpicklings"] for r in results] == [1] * len(results)


# --------------------------------------------------------------------------------------------
# Single-process unit tests of ckpt/format/logical_format.py's pieces.
# --------------------------------------------------------------------------------------------
@pytest.fixture
def patched():
    """ckpt.format.logical_format installed for the test, uninstalled after (the pytest process is shared)."""
    from ckpt.format import logical_format

    was = logical_format.is_installed()
    logical_format.install()
    try:
        yield logical_format
    finally:
        if not was:
            logical_format.uninstall()


def test_install_replaces_megatron_functions_everywhere_and_uninstall_restores():
    import megatron.core.dist_checkpointing.optimizer as dopt
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.mlp as mlp
    import megatron.core.utils as mutils

    from ckpt.format import logical_format

    logical_format.uninstall()
    originals = (mutils.make_tp_sharded_tensor_for_checkpoint, mlp.apply_swiglu_sharded_factory,
                 dopt.get_param_id_to_sharded_param_map)
    assert all(f.__module__.startswith("megatron.core") for f in originals)
    logical_format.configure("logical")
    try:
        assert logical_format.is_installed()
        for module in (mutils, layers):
            assert module.make_tp_sharded_tensor_for_checkpoint is \
                logical_format.make_tp_sharded_tensor_for_checkpoint
        assert mlp.apply_swiglu_sharded_factory is logical_format.apply_swiglu_sharded_factory
        for module in (dopt, mopt):
            assert module.get_param_id_to_sharded_param_map is \
                logical_format.get_param_id_to_sharded_param_map
        logical_format.install()  # idempotent
    finally:
        logical_format.configure("stock")
    assert not logical_format.is_installed()
    assert (mutils.make_tp_sharded_tensor_for_checkpoint, mlp.apply_swiglu_sharded_factory,
            dopt.get_param_id_to_sharded_param_map) == originals
    assert layers.make_tp_sharded_tensor_for_checkpoint is originals[0]
    assert mopt.get_param_id_to_sharded_param_map is originals[2]
    with pytest.raises(ValueError, match="checkpoint.format='padded'.*logical.*stock"):
        logical_format.configure("padded")


def _spec(L, tp, tp_rank, g, gtp_rank, a, tp_axis=0, gated=False, cols=3, prepend=((0, 1, 2),)):
    from ckpt.format.logical_factory import LogicalSpec
    from gtp.shards import GTPShard

    shard = GTPShard(L=L, tp=tp, tp_rank=tp_rank, g=g, gtp_rank=gtp_rank,
                     pad_for_alignment=a, tp_axis=tp_axis, gated=gated)
    return LogicalSpec(shard, prepend, cols)


def test_factory_pieces_of_the_spec_worked_case():
    """Spec section 3: tp=2, g=2, L=10, a=3 (pad 2, shard 6). Hand-computed: TP rank k, GTP
    rank r holds logical rows [6r, min(6r+6, 10)) of TP shard k, i.e. full rows 10k + those."""
    from ckpt.format.logical_factory import make_factory

    want = {(0, 0): (0, 6), (0, 1): (6, 4), (1, 0): (10, 6), (1, 1): (16, 4)}
    for (k, r), (offset, rows) in want.items():
        spec = _spec(10, 2, k, 2, r, 3)
        shard = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) + 100
        factory = make_factory(shard, "w", spec, replica_id=(0, 0, 0))
        assert factory.live_param is shard and factory.data is shard
        (piece,) = factory.build()
        assert piece.global_shape == (2, 20, 3) and piece.global_offset == (1, offset, 0)
        assert piece.axis_fragmentations is None and not piece.allow_shape_mismatch
        assert piece.data.shape == (1, rows, 3)
        assert piece.data.data_ptr() == shard.data_ptr()  # a view: no copy
        merged = factory.merge_fn([piece.data.clone()])
        assert torch.equal(merged[:rows], shard[:rows]) and not merged[rows:].any()


def test_factory_all_padding_shard_and_row_parallel():
    from ckpt.format.logical_factory import make_factory

    # L=72, g=4, a=32: rank 3 holds only padding -> one empty piece at the end of the tensor.
    spec = _spec(72, 1, 0, 4, 3, 32, tp_axis=1, cols=5)
    (piece,) = make_factory(torch.ones(32, 5), "w", spec, 0).build()
    assert piece.data.shape == (1, 0, 5)
    assert piece.global_shape == (2, 72, 5) and piece.global_offset == (1, 72, 0)
    # Row-parallel at tp2: the TP split stays on dim 1.
    spec = _spec(72, 2, 1, 4, 2, 32, tp_axis=1, cols=5)
    (piece,) = make_factory(torch.ones(32, 5), "w", spec, 0).build()
    assert piece.global_shape == (2, 72, 10) and piece.global_offset == (1, 64, 5)
    assert piece.data.shape == (1, 8, 5)


def test_factory_gated_fc1_straddling_gate_and_up():
    """tp2 x g2/a16, L=200 (gate 100 + up 100 rows per TP rank), pad 24, shard 112: GTP rank 0
    of TP rank 1 holds gate rows 0-99 and up rows 0-11 of TP rank 1; the file is
    [W_0; W_1; V_0; V_1] (400 rows): gate at 100, up at 300."""
    from ckpt.format.logical_factory import make_factory

    spec = _spec(200, 2, 1, 2, 0, 16, gated=True, cols=2)
    shard = torch.arange(112 * 2, dtype=torch.float32).reshape(112, 2)
    gate, up = make_factory(shard, "fc1", spec, 0).build()
    assert (gate.global_offset, gate.data.shape) == ((1, 100, 0), (1, 100, 2))
    assert (up.global_offset, up.data.shape) == ((1, 300, 0), (1, 12, 2))
    assert gate.global_shape == up.global_shape == (2, 400, 2)
    spec = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2)  # rank 1: up rows 12-99 only
    (up,) = make_factory(shard, "fc1", spec, 0).build()
    assert (up.global_offset, up.data.shape) == ((1, 312, 0), (1, 88, 2))


def test_optimizer_lookup_uses_the_back_link_and_refuses_a_miss(patched):
    """megatron's lookup matches by id(entry.data) and skips a miss silently; ours follows the
    entry's back-link and raises, naming the param."""
    import megatron.core.dist_checkpointing.optimizer as dopt
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stock = patched._ORIGINALS["get_param_id_to_sharded_param_map"]
    a, b = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(6, 3))
    b._debug_name = "decoder.layers.0.mlp.linear_fc2.weight"
    entry_a = ShardedTensor.from_rank_offsets("a", a)
    # An entry whose data is a new tensor (as a trimmed view or a dequantized copy would be).
    spec = _spec(6, 1, 0, 1, 0, 0, cols=3, prepend=())
    entry_b = patched.make_factory(b, "b", spec, 0)
    entry_b.data = b.detach().clone()
    assert set(stock({"a": entry_a, "b": entry_b}, [a, b])) == {0}  # b silently dropped
    assert set(dopt.get_param_id_to_sharded_param_map({"a": entry_a, "b": entry_b}, [a, b])) == {0, 1}
    with pytest.raises(patched.GTPCheckpointError, match=r"1 optimizer params.*linear_fc2.*\(6, 3\)"):
        dopt.get_param_id_to_sharded_param_map({"a": entry_a}, [a, b])


def test_factory_save_pieces_alias_the_shard_without_a_storage_to_clone(tmp_path):
    """megatron's torch_dist writer clones every CPU tensor whose storage is larger than the
    tensor (``torch.save`` writes whole storages). A trimmed piece of a padded shard shares the
    shard's memory yet owns a storage of exactly its rows: the writer neither clones it nor writes
    the padding rows."""
    from ckpt.format.logical_factory import make_factory

    # tp2 x g2/a16, L=200, TP rank 1: GTP rank 0 holds gate rows 0-99 and up rows 0-11 (two
    # pieces of the 112-row shard); GTP rank 1 holds up rows 12-99 and 24 padding rows.
    shard = torch.randn(112, 64).to(torch.bfloat16)
    row_bytes = 64 * shard.element_size()
    for gtp_rank, los in ((0, (0, 100)), (1, (0,))):
        pieces = make_factory(shard, "fc1", _spec(200, 2, 1, 2, gtp_rank, 16, gated=True, cols=64),
                               0).build()
        assert len(pieces) == len(los)
        for piece, lo in zip(pieces, los):
            data = piece.data
            rows = data.shape[1]
            assert data.untyped_storage().nbytes() == data.numel() * data.element_size()
            assert data.data_ptr() == shard.data_ptr() + lo * row_bytes  # no copy
            assert torch.equal(data[0], shard[lo:lo + rows])
            torch.save(data, tmp_path / "piece.pt")
            torch.save(data.clone(), tmp_path / "copy.pt")  # what the writer's clone writes
            torch.save(shard[lo:lo + rows], tmp_path / "view.pt")  # a plain view: whole storage
            size = {n: (tmp_path / f"{n}.pt").stat().st_size for n in ("piece", "copy", "view")}
            # (a few bytes of zip metadata differ)
            assert abs(size["piece"] - size["copy"]) < 64, size
            assert size["view"] - size["piece"] > (112 - rows) * row_bytes - 64, size


def test_factory_merge_fills_the_live_shard_in_place():
    """Load: the reader fills the pieces (views of the live shard); merge zeroes only the
    padding rows and returns the live shard itself. Pieces read into other tensors are copied
    into it; an optimizer tensor (megatron's ``dataclasses.replace(factory, data=...)``) merges
    into its own tensor, also after megatron's ``without_data()``; without a target the merge
    returns a new zero-padded shard."""
    import dataclasses

    from ckpt.format.logical_factory import _merge_pieces, make_factory

    spec = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2)  # up rows 12-99 (88 rows), pad 24
    want = torch.zeros(112, 2)
    want[:88] = torch.arange(88 * 2, dtype=torch.float32).reshape(88, 2) + 1

    def check(merged, target):
        assert merged.data_ptr() == target.data_ptr()
        assert torch.equal(target, want)

    live = torch.nn.Parameter(torch.full((112, 2), SENTINEL))
    factory = make_factory(live, "fc1", spec, 0)
    (piece,) = factory.build()
    piece.data.copy_(want[:88].view(1, 88, 2))  # as the reader does
    check(factory.merge_fn([piece.data]), live)

    moment = torch.full((112, 2), SENTINEL)
    optim_factory = dataclasses.replace(factory, data=moment)
    check(optim_factory.merge_fn([want[:88].clone().view(1, 88, 2)]), moment)

    # megatron's load_preprocess drops the factories' data before it loads and merges.
    live.data.fill_(SENTINEL)
    check(factory.without_data().merge_fn([want[:88].clone().view(1, 88, 2)]), live)

    fresh = _merge_pieces(spec, [want[:88].clone().view(1, 88, 2)])  # no target: a new shard
    assert fresh.data_ptr() not in (live.data_ptr(), moment.data_ptr())
    assert torch.equal(fresh, want)


def test_stored_rows_limit_reads_only_the_kept_rows():
    """A vocabulary weight of 320 padded rows (tp1, g2, GTP rank 1 holds rows 160-319) read
    from a file of 258 rows of which 257 are real: one piece of rows 160-256 at offset 160 of
    258; merge fills them in place and zeroes the rest. With every row of the rank past the
    kept ones, one empty piece at the end of the stored tensor (as an all-padding shard)."""
    from ckpt.format.logical_factory import GTPCheckpointError, make_factory, with_stored_rows

    spec = _spec(320, 1, 0, 2, 1, 16, cols=2, prepend=())
    live = torch.nn.Parameter(torch.full((160, 2), SENTINEL))
    factory = with_stored_rows(make_factory(live, "output_layer.weight", spec, 0), 258, 257)
    (piece,) = factory.build()
    assert (piece.global_shape, piece.global_offset, tuple(piece.data.shape)) == (
        (258, 2), (160, 0), (97, 2))
    assert piece.data.data_ptr() == live.data_ptr()
    loaded = torch.arange(97 * 2, dtype=torch.float32).reshape(97, 2) + 1
    piece.data.copy_(loaded)  # as the reader does
    merged = factory.merge_fn([piece.data])
    assert merged.data_ptr() == live.data_ptr()
    assert torch.equal(live[:97], loaded) and torch.equal(live[97:], torch.zeros(63, 2))
    # An optimizer tensor of the param merges into its own tensor, cut the same way.
    moment = torch.full((160, 2), SENTINEL)
    import dataclasses

    optim_factory = dataclasses.replace(factory, data=moment)
    assert optim_factory.merge_fn([loaded.clone()]).data_ptr() == moment.data_ptr()
    assert torch.equal(moment[:97], loaded) and not moment[97:].any()

    (empty,) = with_stored_rows(make_factory(live, "k", spec, 0), 258, 100).build()
    assert (empty.global_offset[0], empty.global_shape[0], empty.data.shape[0]) == (258, 258, 0)
    with pytest.raises(GTPCheckpointError, match="kept_rows=300 not within"):
        with_stored_rows(make_factory(live, "k", spec, 0), 258, 300)
    gated = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2, prepend=())
    with pytest.raises(GTPCheckpointError, match="column-parallel, non-gated"):
        with_stored_rows(make_factory(torch.zeros(112, 2), "fc1", gated, 0), 200, 100)


def test_native_fp8_weight_goes_through_a_dequantized_copy(monkeypatch):
    """gtp.fp8_param_gather keeps GTP weights in FP8 (TransformerEngine, not here: a stand-in
    marks the param as FP8). The pieces are cut from megatron's dequantized copy, a load fills
    that copy (the model's load_state_dict then quantizes it into the param), and the
    optimizer still finds the param's entry through the back-link."""
    import megatron.core.fp8_utils as fp8_utils
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_mod

    from ckpt.format.logical_format import get_param_id_to_sharded_param_map
    from ckpt.format.logical_factory import high_precision_data, make_factory

    live = torch.nn.Parameter(torch.full((112, 2), 3.0))
    copies = []
    monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: t is live)
    monkeypatch.setattr(gtp_mod, "dequantize_gtp_native_fp8",
                        lambda t: copies.append(t.detach().clone()) or copies[-1])
    plain = torch.nn.Parameter(torch.zeros(112, 2))
    assert high_precision_data(plain) is plain and not copies
    data = high_precision_data(live)
    assert copies == [data] and data.data_ptr() != live.data_ptr()

    spec = _spec(200, 2, 1, 2, 1, 16, cols=2, prepend=())  # rows 0-87 logical, pad 24
    factory = make_factory(live, "fc2", spec, 0, data=data)
    assert factory.live_param is live and factory.data is data
    (piece,) = factory.build()
    assert piece.data.data_ptr() == data.data_ptr()
    piece.data.fill_(7.0)
    merged = factory.merge_fn([piece.data])
    assert merged.data_ptr() == data.data_ptr()
    assert bool((data[:88] == 7).all()) and not data[88:].any()
    assert bool((live == 3).all())  # the FP8 param itself changes only in load_state_dict
    assert get_param_id_to_sharded_param_map({"fc2": factory}, [live]) == {0: factory}


# --------------------------------------------------------------------------------------------
# Pipeline parallelism and the distributed optimizer.
# --------------------------------------------------------------------------------------------
def test_pipeline_and_distributed_optimizer_pairs_restore_everything(matrix):
    """Every save/load pair of PP_LAYOUTS: bf16 weights, fp32 main params, exp_avg, exp_avg_sq
    and step equal the goldens, on every rank, padding rows zero."""
    _, results = matrix
    for rank, res in enumerate(results):
        pp = res["pp"]
        assert set(pp["loads"]) == {(s, d) for s in PP_LAYOUTS for d in PP_LAYOUTS}
        for (src, dst), (n, problems) in sorted(pp["loads"].items()):
            assert n > 20, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
    # Each distributed-optimizer rank holds part of the optimizer state, never all of it.
    for name in ("pp2dp2do", "g2a16dp2do"):
        assert all(r["pp"]["filled"][name] > 0 for r in results), name


def test_virtual_pipeline_pairs_restore_everything(matrix):
    """Every save/load pair of VPP_LAYOUTS (pp2 x vpp2 with the distributed optimizer or GTP,
    and pp1): weights, fp32 main params, Adam moments and step equal the goldens on every rank."""
    _, results = matrix
    for rank, res in enumerate(results):
        vpp = res["vpp"]
        assert set(vpp["loads"]) == {(s, d) for s in VPP_LAYOUTS for d in VPP_LAYOUTS}
        for (src, dst), (n, problems) in sorted(vpp["loads"].items()):
            assert n > 20, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
    records = results[0]["vpp"]["records"]
    assert records["l4_pp2v2dp2do"]["virtual_pipeline_model_parallel_size"] == 2


def test_wrong_layer_offset_and_dropped_optimizer_bucket_are_caught(matrix):
    """Negative controls. A pp2 model whose last stage numbers its layers from 0 (a wrong layer
    offset) asks for layer 0 twice and layer 1 never: the load is refused (megatron's sharding
    validation, reported by rank 0; the others report the failure of another rank) and nothing
    is loaded: the weights still hold the sentinel, so the pipeline check fails everywhere. A
    distributed-optimizer save whose first bucket's state was lost (zeros) is found by the
    check on every rank."""
    _, results = matrix
    for rank, res in enumerate(results):
        neg = res["pp"]["negative"]
        wrong = neg["wrong_offset"]
        assert wrong["error"], (rank, wrong)
        if rank == 0:
            assert "Invalid access pattern" in wrong["error"], wrong["error"]
            assert "decoder.layers." in wrong["error"], wrong["error"]
        assert any("weight" in p for p in wrong["problems"]), (rank, wrong["problems"][:3])
        dropped = neg["dropped_bucket"]
        assert any("exp_avg" in p for p in dropped), (rank, dropped[:3])
        assert any("fp32 main param" in p for p in dropped), (rank, dropped[:3])


def test_checkpoint_records_pipeline_and_optimizer(matrix):
    records = matrix[1][0]["pp"]["records"]
    assert records["tp2pp2"]["pipeline_model_parallel_size"] == 2
    assert records["tp2pp2"]["tensor_model_parallel_size"] == 2
    assert records["tp2pp2"]["virtual_pipeline_model_parallel_size"] is None
    assert records["tp1"]["pipeline_model_parallel_size"] == 1
    assert not records["tp1"]["use_distributed_optimizer"]
    do = records["g2a16dp2do"]
    assert do["use_distributed_optimizer"] and do["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    assert (do["gtp_remat_size"], do["data_parallel_size"], do["pad_for_alignment"]) == (2, 2, 16)


def _cli(*argv):
    import io

    from ckpt.cli import main

    out = io.StringIO()
    return main([str(a) for a in argv], out=out), out.getvalue()


def test_inspect_shows_pipeline_and_optimizer(matrix):
    root = matrix[0] / "pp"
    rc, out = _cli("inspect", root / "tp2pp2")
    assert rc == 0, out
    assert "parallelism: tp2 x pp2 (vpp -) x gtp1 x dp1, world 4" in out, out
    assert "optimizer: Adam (megatron's non-distributed optimizer" in out, out
    rc, out = _cli("inspect", root / "g2a16dp2do")
    assert rc == 0, out
    assert "parallelism: tp1 x pp1 (vpp -) x gtp2 (pad 16) x dp2, world 4" in out, out
    assert "optimizer: distributed Adam (megatron's DistributedOptimizer, format " \
           "fully_sharded_model_space)" in out, out


@pytest.mark.parametrize("other", ["pp2", "tp2pp2", "pp2dp2do", "g2a16dp2do"])
def test_compare_equal_across_pipeline_and_optimizer_kinds(matrix, other):
    """Same goldens at every layout: the files hold the same logical tensors (fp32 main params
    named alike whichever optimizer wrote them) and the same step."""
    root = matrix[0] / "pp"
    rc, out = _cli("compare", root / "tp1", root / other)
    assert rc == 0, out
    assert "EQUAL:" in out and "optimizer step 7.0" in out, out
