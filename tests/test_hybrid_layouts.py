"""The hybrid family's checkpoints (``model=hybrid_gdn_tiny``: Mamba, GatedDeltaNet, attention
and MLP layers, "MG*-MG") across layouts, through the recipe's own model, optimizer and
checkpoint code: every weight and Adam moment exact, padding rows included.

One 4-process gloo world hosts every layout of the five matrices below in turn (the last two:
multi-token prediction, ``qwen3_next_tiny`` as "GE*E/G*E", and ``hybrid_gdn_tiny`` as
"MG*-MG/M*-" under TP). Each builds
the model through ``recipes.run.worker.setup``, sets every weight, fp32 main param and Adam
moment to a golden built by hand (tests/helpers/layout_goldens.py: each parameter's full tensor
holds ``k*1024 + row + (index in row)/256``, cut to a rank by slicing, the packed ``in_proj``
and ``conv1d`` weights component by component), saves through ``ckpt.io``, then loads every
checkpoint into each layout pre-filled with a sentinel and compares exactly.

Where the GTP shards fall. Mamba's ``in_proj`` (230 rows, ``z96 | x96 | B16 | C16 | dt6``, 115
a TP rank): g2/a16 at tp1 cuts inside ``x`` (shards of 128); tp2 x g2/a16 cuts inside ``x`` of
each TP rank's rows (shards of 64, 13 padding rows after ``dt``); g2/a1 cuts at row 115, row 19
of ``x``. GatedDeltaNet's ``in_proj`` (120 rows, ``query24 | key24 | value32 | z32 | beta4 |
alpha4``, 60 a TP rank): g2/a16 cuts inside ``value`` (shards of 64), tp2 x g2/a16 inside each
TP rank's ``value`` (shards of 32, 4 padding rows), g4/a32 inside ``key``, ``value`` and ``z``,
g2/a1 inside ``value``. g4/a32 gives the 48-row ``out_proj``, ``linear_proj`` and ``linear_fc2``
shards of 32, 16, 0 and 0 rows (all padding on GTP ranks 2 and 3). pp2 (with the distributed
optimizer) puts layers 3-5 ("-MG") on stage 1 (their global numbers in the checkpoint).

In bf16 (bf16 weights, fp32 main params): the plain and the distributed optimizer read each
other's files, ``conv1d``'s and (without GTP) ``in_proj``'s main params stored as their
components (``ckpt.adapt.optim_checkpoint.prepare_one``).
"""

from __future__ import annotations


import pytest
import torch

from layout_goldens import make_cfg, pair_problems, save_and_load_pairs
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
MODEL = "hybrid_gdn_tiny"
_PP2 = "parallelism.pipeline_model_parallel_size=2"
_DISTOPT = "optim.use_distributed_optimizer=true"
# name: (tp, g, pad_for_alignment, extra overrides); data parallel fills the world.
LAYOUTS = {
    "tp1": (1, 1, None, ()),
    "tp2": (2, 1, None, ()),
    "g2a16": (1, 2, 16, ()),
    "tp2g2a16": (2, 2, 16, ()),
    "g4a32": (1, 4, 32, ()),
    "g2a1": (1, 2, 1, ()),  # in_proj shards of 115 rows: rank 1 from row 19 of x
    "pp2dp2do": (1, 1, None, (_PP2, _DISTOPT)),
}
# (Every pair loads: 7 layouts, 49 loads. Pipeline stages with GTP and the distributed optimizer
# with GTP are the bf16 test's, below, and tests/test_mamba_layouts.py's.)


def test_every_weight_and_moment_of_the_hybrid_model_loads_exactly_at_every_layout(matrices):
    problems = pair_problems(matrices["gdn"])
    assert not problems, "\n".join(problems[:40])


# bf16: plain (Float16 optimizer, fp32_param.<key>) and distributed (param.<key>) optimizers.
BF16_LAYOUTS = {
    "bf16 tp1": (1, 1, None, ()),
    "bf16 g2a16do": (1, 2, 16, (_DISTOPT,)),
    "bf16 tp2g2a16": (2, 2, 16, ()),
    "bf16 pp2g2a16do": (1, 2, 16, (_PP2, _DISTOPT)),
}


def test_bf16_main_params_and_moments_load_exactly_across_optimizer_kinds(matrices):
    problems = pair_problems(matrices["bf16"])
    assert not problems, "\n".join(problems[:40])


# MoE layers (model=hybrid_moe_tiny, "ME*E": Mamba, MoE, attention, MoE; 4 SwiGLU experts of
# width 40, sigmoid routing with the expert bias, a shared expert of width 32) at the expert
# layouts and at tp2 with sequence parallelism (megatron's MoE layers need it at TP > 1): every
# pair loads,
# each router's expert_bias included, and megatron built the family's table at each layout.
_EP2 = "parallelism.expert_model_parallel_size=2"
_EGTP2 = ("gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16")
MOE_LAYOUTS = {
    "moe ep1": (1, 1, None, ()),
    "moe ep2do": (1, 1, None, (_EP2, _DISTOPT)),
    "moe ep2etp2": (1, 1, None, (_EP2, "parallelism.expert_tensor_parallel_size=2")),
    "moe ep2egtp2": (1, 1, None, (_EP2, *_EGTP2)),  # expert fc1 80 -> 96 rows, fc2 48 -> 64
    "moe g2egtp2do": (1, 2, 16, (*_EGTP2, _DISTOPT)),  # dense and expert GTP 2
    # Dense GTP 2, the experts whole (expert GTP 1): the distributed optimizer's expert ranges
    # are each written by one rank (their GTP peers are expert GTP peers, not dense ones).
    "moe g2do": (1, 2, 16, (_DISTOPT,)),
    "moe g2ep2do": (1, 2, 16, (_EP2, _DISTOPT)),
    # MoE layers at TP 2 with sequence parallelism, experts split by EP 2 and expert TP 2.
    "moe tp2sp ep2": (2, 1, None, ("parallelism.sequence_parallel=true", _EP2)),
}


def table_problems(model, cfg) -> list[str]:
    """The built parameters of this rank (global names, full logical shapes) against the
    family's table: every name and shape, every table entry this rank holds (its experts); and
    one router ``expert_bias`` per MoE layer."""
    from megatron.core import parallel_state as ps

    from layout_goldens import full_shape, global_names
    from recipes.families import parameter_shapes
    from recipes.model.shapes import padded_vocab_size

    local = int(cfg.model.num_moe_experts) // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * local
    want = {}
    vocab = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by, 1)
    for entry in parameter_shapes(cfg.model, vocab):
        name = entry.name.replace(".local_experts.", ".experts.")  # global_names' form
        if entry.expert and not first <= int(name.split(".experts.experts.")[1].split(".")[0]) \
                < first + local:
            continue  # another EP rank's expert
        want[name] = tuple(entry.shape)
    got = {name: full_shape(p, name) for name, p in global_names(model).values()}
    biases = len(global_names(model, buffers=True))
    return [f"{n}: built {got.get(n)}, table {want.get(n)}"
            for n in sorted(got.keys() | want.keys()) if got.get(n) != want.get(n)] + (
        [] if biases == cfg.model.hybrid_layer_pattern.count("E") else [f"{biases} biases"])


# Multi-token prediction (qwen3_next_tiny as "GE*E/G*E" with mtp_num_layers=1 and 2 experts:
# one MTP depth of GatedDeltaNet, gated attention and MoE layers, megatron's
# mtp.layers.0.mtp_model_layer.layers.{0,1,2}), bf16: its GatedDeltaNet in_proj (120 rows) padded
# to 128 under g2/a16 inside the MTP stack as in the decoder, eh_proj (48 rows) GTP-sharded, the
# MTP layer and megatron's copy of the word embedding on the last of two pipeline stages, its
# experts over ep2 (with dense GTP 2 and the distributed optimizer); every pair loads and every
# layout builds the family's table.
MTP_MODEL = ("model.hybrid_layer_pattern='GE*E/G*E'", "model.num_layers=4",
             "model.mtp_num_layers=1", "model.num_moe_experts=2", "precision=bf16")
MTP_LAYOUTS = {
    "mtp tp1": (1, 1, None, ()),
    "mtp g2a16": (1, 2, 16, ()),
    "mtp pp2dp2do": (1, 1, None, (_PP2, _DISTOPT)),
    "mtp g2a16ep2do": (1, 2, 16, (_EP2, _DISTOPT)),
}
# And Mamba in the MTP layer under TP (MoE layers refuse TP > 1): hybrid_gdn_tiny as
# "MG*-MG/M*-", fp32, tp1 and tp2 x g2/a16 (the MTP layer's Mamba in_proj 230 rows, 115 a TP
# rank, GTP shards of 64: 13 padding rows after dt).
MTP_TP_MODEL = ("model.hybrid_layer_pattern='MG*-MG/M*-'", "model.mtp_num_layers=1")
MTP_TP_LAYOUTS = {"mtp tp1": (1, 1, None, ()), "mtp tp2g2a16": (2, 2, 16, ())}
# Under pp2 the last stage holds these, the embedding's copy as megatron builds it for MTP.
MTP_LAST_STAGE = {"embedding.word_embeddings.weight", "mtp.layers.0.eh_proj.weight"}


def whole_table_problems(model, cfg) -> dict:
    """Collective: ``{"table": problems, "weights": {global name: initial weight}}``: the
    parameters built on every rank (global names, full logical shapes, the union over the
    world) against the family's table, both ways; under pipeline parallelism,
    :data:`MTP_LAST_STAGE` missing from a last-stage rank; and this rank's weights as built
    (before any fill), in fp32."""
    from megatron.core import parallel_state as ps

    from layout_goldens import full_shape, global_names
    from recipes.families import parameter_shapes
    from recipes.model.shapes import padded_vocab_size

    mine = {name: full_shape(p, name) for name, p in global_names(model).values()}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    got = {k: v for d in every for k, v in d.items()}
    vocab = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by,
                              ps.get_tensor_model_parallel_world_size())
    want = {e.name.replace(".local_experts.", ".experts."): tuple(e.shape)
            for e in parameter_shapes(cfg.model, vocab)}
    problems = [f"{n}: built {got.get(n)}, table {want.get(n)}"
                for n in sorted(got.keys() | want.keys()) if got.get(n) != want.get(n)]
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_pipeline_last_stage():
        problems += [f"last stage lacks {n}" for n in sorted(MTP_LAST_STAGE - mine.keys())]
    return {"table": problems, "weights": {name: p.detach().float().clone()
                                           for name, p in global_names(model).values()}}


_INSPECT = {"moe": table_problems, "mtp": whole_table_problems, "mtp_tp": whole_table_problems}


def _matrices(root: str, cfgs: dict) -> dict:
    """The matrices of this file, one after another in one world."""
    return {kind: save_and_load_pairs(f"{root}/{kind}", kind_cfgs, _INSPECT.get(kind))
            for kind, kind_cfgs in cfgs.items()}


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """{"gdn" | "bf16" | "moe" | "mtp" | "mtp_tp": per-rank save_and_load_pairs results}, from one
    4-rank world."""
    root = tmp_path_factory.mktemp("hybrid_layouts")
    cfgs = {
        "gdn": {name: make_cfg(MODEL, tp, g, pad, WORLD, "logical", *extra)
                for name, (tp, g, pad, extra) in LAYOUTS.items()},
        "bf16": {name: make_cfg(MODEL, tp, g, pad, WORLD, "logical", "precision=bf16", *extra)
                 for name, (tp, g, pad, extra) in BF16_LAYOUTS.items()},
        "moe": {name: make_cfg("hybrid_moe_tiny", tp, g, pad, WORLD, "logical", *extra)
                for name, (tp, g, pad, extra) in MOE_LAYOUTS.items()},
        "mtp": {name: make_cfg("qwen3_next_tiny", tp, g, pad, WORLD, "logical", *MTP_MODEL, *extra)
                for name, (tp, g, pad, extra) in MTP_LAYOUTS.items()},
        "mtp_tp": {name: make_cfg("hybrid_gdn_tiny", tp, g, pad, WORLD, "logical", *MTP_TP_MODEL,
                                  *extra) for name, (tp, g, pad, extra) in MTP_TP_LAYOUTS.items()},
    }
    for kind in cfgs:
        (root / kind).mkdir()
    results = run_distributed(_matrices, WORLD, str(root), cfgs, timeout=2400)
    return {kind: [res[kind] for res in results] for kind in cfgs}


def test_moe_layers_load_exactly_at_every_expert_layout(matrices):
    results = matrices["moe"]
    problems = pair_problems(results)
    assert not problems, "\n".join(problems[:40])
    for rank, res in enumerate(results):
        assert all(not p for p in res["inspected"].values()), (rank, res["inspected"])
        for (source, target), (n, _) in res["loads"].items():
            assert n > 0, (source, target)


@pytest.mark.parametrize("kind, layouts", [("mtp", MTP_LAYOUTS), ("mtp_tp", MTP_TP_LAYOUTS)])
def test_mtp_layers_load_exactly_at_every_layout_and_build_the_table(matrices, kind, layouts):
    results = matrices[kind]
    problems = pair_problems(results)
    assert not problems, "\n".join(problems[:40])
    for rank, res in enumerate(results):
        assert sorted(res["inspected"]) == sorted(layouts)
        tables = {name: got["table"] for name, got in res["inspected"].items()}
        assert all(not p for p in tables.values()), (rank, tables)
        for (source, target), (n, _) in res["loads"].items():
            assert n > 0, (source, target)


def test_both_pipeline_stages_start_from_the_weights_built_at_tp1(matrices):
    """Built at pp2 (no TP, GTP or EP: whole tensors), every weight of both stages, the MTP
    layer's included, is the one built at tp1: the last stage replays the first stage's draws
    (``recipes.model.build``, the hybrid family's ``prefix_pattern``) and megatron's copy of the
    word embedding there draws nothing (the GPT family's ``mtp_embedding_copy_draws_nothing``)."""
    whole = {}
    for res in matrices["mtp"]:
        whole.update(res["inspected"]["mtp tp1"]["weights"])
    seen, differ = set(), []
    for res in matrices["mtp"]:
        for name, w in res["inspected"]["mtp pp2dp2do"]["weights"].items():
            seen.add(name)
            if not torch.equal(w, whole[name]):
                differ.append(name)
    assert not differ, sorted(set(differ))
    assert seen == set(whole)
