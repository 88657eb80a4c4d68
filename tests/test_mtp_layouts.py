"""Multi-token prediction checkpoints across layouts, on CPU: every weight and Adam moment of a
Llama with one MTP layer (``model.mtp_num_layers=1``) restored exactly at every pair of
{tp1, tp2 x g2/a16, g4/a32, pp2 x dp2 with the distributed optimizer, pp2 x g2/a16}; and of a
tied Llama between tp1 and pp2 x dp2 with the distributed optimizer. An MoE model's MTP layer
(whose MLP is MoE) starts from the same expert weights at ep1 and ep2 (its checkpoints across
expert layouts: tests/test_moe_checkpoint_layouts.py). A checkpoint megatron-core 0.19.2's own
(padded) writer saved at tp2 x g2/a16 loads exactly at every layout through ``ckpt.stock``; and
megatron's own reader, reading a tp2 save into tp2 x g2/a16, misplaces the MTP layer's rows.

One 4-process gloo world builds each layout through ``recipes.run.worker.setup`` (bf16 weights,
fp32 main params), fills every parameter, main param and moment with goldens built
independently of the code under test (tests/helpers/layout_goldens.py: each full logical
tensor ``k*1024 + row + col/256``, cut by plain TP slicing and GTP tail padding), saves, then
loads every checkpoint into each layout pre-filled with a sentinel and compares with
``torch.equal``.

The cases the layouts make run: at g4/a32, GTP rank 3 of ``mtp.layers.0.eh_proj`` (72 rows ->
32, 32, 8, 0) and of the MTP layer's ``linear_proj``/``linear_fc2`` holds only padding; at
tp2 x g2/a16 the MTP layer's SwiGLU fc1 (200 rows per TP rank) pads 24 rows; under pp2 the last
stage holds the MTP layer and megatron's copy of the word embedding, which must come back as
the embedding's rows (its golden is the embedding's). Under pp2 with the distributed optimizer,
the first stage's embedding of both models sits in a grad-buffer bucket of its own, which
megatron-core 0.19.2's ``fully_reshardable`` save got wrong (``mcore_compat.distrib_optimizer``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layout_goldens import build, check, fill, make_cfg
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
_PP2 = ("parallelism.pipeline_model_parallel_size=2",)
# name: (tp, g, pad_for_alignment, extra overrides); data-parallel size = 4 / (tp * pp * g).
LAYOUTS = {
    "tp1": (1, 1, None, ()),
    "tp2g2a16": (2, 2, 16, ()),
    "g4a32": (1, 4, 32, ()),
    "pp2dp2do": (1, 1, None, (*_PP2, "optim.use_distributed_optimizer=true")),
    "pp2g2a16": (1, 2, 16, _PP2),
}
PP1 = ("tp1", "tp2g2a16", "g4a32")
# megatron-core 0.19.2's own (stock, padded) writer at tp2 x g2/a16: read through ckpt.stock at
# every layout above.
STOCK = {"stock_tp2g2a16": (2, 2, 16, ())}
# The discriminating read: the plain-MLP tiny model with an MTP layer saved at tp2 (no GTP),
# read into tp2 x g2/a16 by megatron's own reader and by the logical one. (megatron's reader
# refuses a SwiGLU model's fc1 outright: a global shape mismatch.)
ASYM = {"asym_tp2": (2, 1, None, ()), "asym_tp2g2a16": (2, 2, 16, ())}
# moe_tiny with one MTP layer (an MoE layer, as the decoder's last) without and with expert
# parallelism: the MTP layer's experts start from the same weights at both (each expert draws
# from its own seed, recipes.families.moe.model.init_experts).
MOE_LAYOUTS = {
    "moe_tp1": (1, 1, None, ()),
    "moe_ep2": (1, 1, None, ("parallelism.expert_model_parallel_size=2",)),
}
# A tied llama_tiny (no MTP) saved at pp2 with the distributed optimizer: its first stage's
# embedding is megatron's ``shared_embedding`` too, in a bucket of its own
# (mcore_compat.distrib_optimizer.with_bucket_padding).
TIED_LAYOUTS = {
    "tied_tp1": (1, 1, None, ()),
    "tied_pp2dp2do": (1, 1, None, (*_PP2, "optim.use_distributed_optimizer=true")),
}


def _gpt(model):
    """The ``GPTModel`` inside DDP (and, in bf16, megatron's ``Float16Module``)."""
    gpt = model.module
    return getattr(gpt, "module", gpt)


def _all_padding(model) -> list[str]:
    """Names of this rank's GTP shards that hold no logical row (only alignment padding)."""
    out = []
    for name, p in _gpt(model).named_parameters():
        if getattr(p, "is_gtp_weight_remat", False):
            if p.group.rank() * p.shape[0] >= p._unsharded_shape[0] - p.pad_length:
                out.append(name)
    return out


def _table_problems(model, cfg, record) -> list[str]:
    """Differences between this rank's parameters and the family's table (pp1 layouts)."""
    from recipes.families import parameter_shapes
    from recipes.model.shapes import local_shape, padded_vocab_size

    tp, g = record["tensor_model_parallel_size"], record["gtp_remat_size"]
    padded = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by, tp)
    want = {p.name: local_shape(p, tp, g, record["pad_for_alignment"])[0]
            for p in parameter_shapes(cfg.model, padded)}
    got = {n: tuple(p.shape) for n, p in _gpt(model).named_parameters()}
    return [f"{n}: built {got.get(n)}, table {want.get(n)}"
            for n in sorted(got.keys() | want.keys()) if got.get(n) != want.get(n)]


def _mtp_experts(model) -> dict:
    """``{name with the global expert index: weight}`` of the MTP layers' routed experts this
    rank holds (expert ``ep_rank * local + i`` for ``local_experts.<i>``)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    out = {}
    for name, p in _gpt(model).named_parameters():
        if name.startswith("mtp.") and ".local_experts." in name:
            head, rest = name.split(".local_experts.")
            i, tail = rest.split(".", 1)
            local = len({n.split(".local_experts.")[1].split(".")[0]
                         for n, _ in _gpt(model).named_parameters() if n.startswith(head + ".")})
            out[f"{head}.local_experts.{ep_rank * local + int(i)}.{tail}"] = p.detach().clone()
    return out


def _worker(root: str, cfgs: dict) -> dict:
    from megatron.core import parallel_state as ps

    from ckpt.format import logical_format
    from ckpt import io as checkpoint

    root = Path(root)
    out = {"loads": {}, "filled": {}, "table": {}, "padding": {}, "last_stage": {}, "experts": {}}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        if name in PP1 or name == "moe_tp1":
            out["table"][name] = _table_problems(model, cfg, record)
        if name in MOE_LAYOUTS:  # built only (saves and loads: test_moe_checkpoint_layouts.py)
            out["experts"][name] = _mtp_experts(model)
            continue
        out["padding"][name] = _all_padding(model)
        if ps.is_pipeline_last_stage():
            out["last_stage"][name] = sorted(n for n, _ in _gpt(model).named_parameters())
        out["filled"][name] = fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(root / name, 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
    for name, cfg_yaml in cfgs.items():
        if name in MOE_LAYOUTS or name in STOCK or name in ASYM:
            continue
        model, opt, sched, record, cfg = build(cfg_yaml)
        for src in cfgs:
            mtp_model = {**LAYOUTS, **STOCK}  # STOCK: the MTP model, written by megatron
            if not ({src, name} <= mtp_model.keys() or {src, name} <= TIED_LAYOUTS.keys()):
                continue  # another model
            fill(model, opt, cfg, sentinel=True)
            checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            out["loads"][(src, name)] = check(model, opt, cfg)
    # The non-GTP save read into a padded GTP layout: megatron-core 0.19.2's reader, ours.
    model, opt, sched, record, cfg = build(cfgs["asym_tp2g2a16"])
    out["asym"] = {}
    for mode in ("stock", "logical"):
        logical_format.configure(mode)
        fill(model, opt, cfg, sentinel=True)
        checkpoint.load_checkpoint(root / "asym_tp2", model, opt, sched, record)
        out["asym"][mode] = check(model, opt, cfg)
    logical_format.configure("logical")
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp_layouts")


@pytest.fixture(scope="module")
def matrix(root):
    cfgs = {name: make_cfg("llama_tiny", tp, g, pad, WORLD, "logical", "precision=bf16",
                           "model.mtp_num_layers=1", *extra)
            for name, (tp, g, pad, extra) in LAYOUTS.items()}
    cfgs.update({name: make_cfg("llama_tiny", tp, g, pad, WORLD, "logical", "precision=bf16",
                                "model.share_embeddings_and_output_weights=true", *extra)
                 for name, (tp, g, pad, extra) in TIED_LAYOUTS.items()})
    cfgs.update({name: make_cfg("moe_tiny", tp, g, pad, WORLD, "logical", "precision=bf16",
                                "model.mtp_num_layers=1", *extra)
                 for name, (tp, g, pad, extra) in MOE_LAYOUTS.items()})
    cfgs.update({name: make_cfg("llama_tiny", tp, g, pad, WORLD, "stock", "precision=bf16",
                                "model.mtp_num_layers=1", *extra)
                 for name, (tp, g, pad, extra) in STOCK.items()})
    cfgs.update({name: make_cfg("tiny", tp, g, pad, WORLD, "logical", "model.mtp_num_layers=1",
                                *extra)
                 for name, (tp, g, pad, extra) in ASYM.items()})
    return run_distributed(_worker, WORLD, str(root), cfgs, timeout=900)


@pytest.mark.parametrize("sources, layouts", [(LAYOUTS, LAYOUTS), (TIED_LAYOUTS, TIED_LAYOUTS),
                                              (STOCK, LAYOUTS)], ids=["mtp", "tied", "stock"])
def test_every_layout_pair_restores_weights_and_moments_exactly(matrix, sources, layouts):
    for rank, res in enumerate(matrix):
        loads = {pair: v for pair, v in res["loads"].items() if pair[0] in sources}
        assert set(loads) == {(s, d) for s in sources for d in layouts}
        for (src, dst), (n, problems) in sorted(loads.items()):
            assert n > 10, (src, dst, n)
            assert not problems, f"rank {rank}: save {src} -> load {dst}: {problems[:6]}"
    for name in layouts:
        assert all(r["filled"][name] > 0 for r in matrix), name


def test_built_mtp_models_have_the_parameters_of_the_table(matrix):
    for rank, res in enumerate(matrix):
        for name, problems in res["table"].items():
            assert not problems, (rank, name, problems[:5])


def test_the_padded_and_pipelined_mtp_cases_ran(matrix):
    padding = {n for r in matrix for n in r["padding"]["g4a32"]}
    assert {"mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight",
            "mtp.layers.0.mtp_model_layer.mlp.linear_fc2.weight"} <= padding, sorted(padding)
    for name in ("pp2dp2do", "pp2g2a16"):
        last = {n for r in matrix for n in r["last_stage"].get(name, [])}
        assert "embedding.word_embeddings.weight" in last and "mtp.layers.0.eh_proj.weight" in last
        assert "decoder.layers.1.mlp.linear_fc1.weight" not in last  # one layer per stage


def test_the_mtp_layers_experts_start_alike_at_every_expert_layout(matrix):
    """Each global expert of the MTP layer holds the same weights at ep1 and ep2 (all four
    experts seen, two per rank at ep2)."""
    merged = {name: {} for name in MOE_LAYOUTS}
    for res in matrix:
        for name in MOE_LAYOUTS:
            merged[name].update(res["experts"][name])
    one, two = merged["moe_tp1"], merged["moe_ep2"]
    assert len(one) == 8 and sorted(one) == sorted(two), sorted(two)  # 4 experts x fc1, fc2
    for key in one:
        assert torch.equal(one[key], two[key]), key


def test_megatrons_reader_misplaces_the_mtp_rows_that_the_logical_reader_restores(matrix):
    """A tp2 save (no GTP) read into tp2 x g2/a16 (fc1 100 rows per TP rank, padded to 128):
    megatron-core 0.19.2's own reader puts rows of the padded weights in the wrong places, the
    MTP layer's among them, with no error; the logical reader restores every one."""
    problems = [p for r in matrix for p in r["asym"]["stock"][1]]
    for name in ("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight weight",
                 "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight exp_avg"):
        assert any(p.startswith(name) for p in problems), (name, problems[:8])
    for rank, r in enumerate(matrix):
        n, logical = r["asym"]["logical"]
        assert n > 10 and not logical, (rank, logical[:5])


def test_a_stock_mtp_checkpoint_with_nothing_recorded_reads_the_same_rows(matrix, root):
    """The stock save without any record of its layout or model (as Megatron-LM's own writer
    leaves it): given the layout, ckpt.stock finds every GTP weight by its name, the MTP
    layer's ``eh_proj`` among them, and reads the rows the recorded checkpoint reads."""
    from megatron.core import dist_checkpointing

    from ckpt import stock

    path = stock.resolve_iter_dir(root / "stock_tp2g2a16")
    common = dist_checkpointing.load_common_state_dict(str(path))
    stripped = {k: v for k, v in common.items()
                if k not in ("layout", "train_state", stock.SHARDING_RECORD_KEY)}
    given = stock.analyze(path, "tp=2,gtp=2,pad=16,padded_vocab_size=320,ffn_hidden_size=200,"
                                "swiglu=true,qkv_rows=120", common=stripped)
    recorded = stock.analyze(path)
    assert given.stock and given.layout_source.startswith("given by the caller")
    assert "mtp.layers.0.eh_proj.weight" in given.tensors
    assert all(given.tensors[k].rowmap == recorded.tensors[k].rowmap for k in recorded.tensors)
    _, got = stock.read_logical(path, analysis=given)
    _, want = stock.read_logical(path, analysis=recorded)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
