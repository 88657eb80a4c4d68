"""Multi-latent attention (megatron's ``MLASelfAttention``, local spec) and gated attention
(``attention_output_gate``) across layouts, on CPU.

One 4-process gloo world, through the recipe's own model, optimizer and checkpoint code
(``recipes.run.worker.setup``; data parallelism fills the world), for llama_tiny with MLA
(:data:`MLA`: 4 heads, ``q_lora_rank`` 40, ``kv_lora_rank`` 24, ``qk_head_dim`` 16,
``qk_pos_emb_head_dim`` 8, ``v_head_dim`` 12, the q/kv norms, YaRN), then with gated attention
(:data:`GATED`, its layouts :data:`GATED_COMPARED` and :data:`GATED_SAVED`):

* forward and backward at tp2, g2/a16, tp2 x g2/a16 and tp2 with sequence parallelism
  against tp1, each layout holding tp1's weights: the loss and every gradient within the fp32
  bound of tests/helpers/tolerance.py (one step, the model's parameter count);
* the parameter table (``recipes.families.parameter_shapes``) against the built model at the
  layouts without pipeline stages (shapes per rank, GTP padding included);
* checkpoints: each of tp1, tp2, g2/a16, tp2 x g2/a16, pp2 x dp2 and g2/a16 x dp2 (both with
  the distributed optimizer), in bf16, saves its goldens; each layout loads the saves of those
  before it, and tp1 every save, into a model and optimizer pre-filled with a sentinel (every
  pair in one direction, one build a layout): bf16 weights, fp32 main params, Adam moments
  and step equal the goldens (tests/helpers/layout_goldens.py: each parameter's full logical
  tensor ``k*1024 + row + col/256``, cut to a rank by hand: TP chunk, GTP zero padding, shard).

Where the shards fall. TP splits the rows of every projection (whole heads of the up
projections, contiguous rows of the down projections) and the columns of ``linear_proj``; GTP
shards each TP-local weight's rows. ``linear_kv_down_proj`` (24 + 8 = 32 rows): at tp2 rank 1
holds the last 8 compressed rows then the key's 8 RoPE rows; at tp2 x g2/a16 its 16 rows pad to
32, so GTP rank 1 holds only padding. ``linear_q_down_proj`` (40 rows) pads to 64 at g2/a16
(rank 1: 8 rows, 24 padding); ``linear_kv_up_proj`` (4 x (16 + 12) = 112 rows) to 128.

Gated attention: ``linear_qkv`` holds per query group ``[q 20 | gate 20 | k 10 | v 10]`` (4 heads
of 10 channels in 2 groups: 120 rows; megatron's ``get_query_key_value_tensors``). At g2/a16
its shards of 64 rows put group 1's first 4 query rows on GTP rank 0 (rank 1: 56 rows, 8
padding); at tp2 each TP rank holds one group (60 rows), its shards of 32 cut inside the gate
(rank 1: gate rows 12-19, k, v, 4 padding). The distributed optimizer (g2/a16 x dp2) cuts the
flat main params and moments across those.
"""

from __future__ import annotations

import time

import pytest
import torch

from layout_goldens import (build, check as golden_check, fill as golden_fill, local, make_cfg,
                            pair_problems)
from multiproc import run_distributed
from tolerance import fp32_rtol

pytestmark = pytest.mark.multiprocess

WORLD = 4
MODEL = "llama_tiny"
MLA = ("model.multi_latent_attention=true", "model.num_attention_heads=4",
       "model.num_query_groups=null", "model.q_lora_rank=40", "model.kv_lora_rank=24",
       "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=12",
       "model.qk_layernorm=true", "model.rope_type=yarn", "model.rotary_scaling_factor=4",
       "model.original_max_position_embeddings=32", "model.mscale_all_dim=0.7",
       "model.transformer_impl=local")
_SP = "parallelism.sequence_parallel=true"
_PP2 = "parallelism.pipeline_model_parallel_size=2"
_DISTOPT = "optim.use_distributed_optimizer=true"
# Forward/backward against tp1 (fp32): name -> (tp, g, pad, extra overrides).
# tp2 with sequence parallelism too (megatron's sequence gathers and scatters in MLA).
COMPARED = {
    "tp2": (2, 1, None, ()),
    "g2a16": (1, 2, 16, ()),
    "tp2g2a16": (2, 2, 16, ()),
    "tp2sp": (2, 1, None, (_SP,)),
}
# Checkpoint pairs (bf16 weights, fp32 main params).
SAVED = {
    "tp1": (1, 1, None, ()),
    "tp2": (2, 1, None, ()),
    "g2a16": (1, 2, 16, ()),
    "tp2g2a16": (2, 2, 16, ()),
    "pp2dp2do": (1, 1, None, (_PP2, _DISTOPT)),
    "g2a16dp2do": (1, 2, 16, (_DISTOPT,)),
}
SEQ, BATCH = 64, 2
# Gated attention (megatron's attention_output_gate) on llama_tiny with 4 heads of 10 channels
# in 2 groups (module docstring: where the shards fall).
GATED = ("model.attention_output_gate=true", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.kv_channels=10", "model.transformer_impl=local")
GATED_COMPARED = {name: COMPARED[name] for name in ("tp2", "g2a16", "tp2g2a16")}
# Last, tp2 x g2/a16 written by megatron's own padded writer (checkpoint.format=stock), which
# tp1 reads through ckpt.stock's conversion (its rows from the run config, gate included).
_STOCK = "checkpoint.format=stock"
GATED_SAVED = {**{name: SAVED[name] for name in ("tp1", "tp2", "g2a16", "tp2g2a16")},
               "g2a16dp2do": SAVED["g2a16dp2do"], "tp2g2a16stock": (2, 2, 16, (_STOCK,))}


def _step(model) -> tuple[float, dict]:
    """One forward and backward of a fixed batch through megatron's schedule (the recipe's
    ``forward_step``; ``finalize_model_grads`` runs): ``(loss, {name: main_grad})``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipes.run.loop import forward_step

    tokens = torch.randint(0, 257, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(BATCH, SEQ),
             "position_ids": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)}
    model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    return losses[0]["lm loss"].item(), grads


def _compare(ref_cfg: str, cfgs: dict) -> dict:
    """``{name: (|loss - tp1 loss|, tp1 loss, {param: (max |grad - tp1 grad|, max |tp1
    grad|)})}`` for each layout, its weights tp1's cut by hand."""
    model, _, _, _, cfg = build(ref_cfg)
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    ref_loss, ref_grads = _step(model)
    out = {}
    for name, cfg_yaml in cfgs.items():
        model, _, _, _, cfg = build(cfg_yaml)
        params = dict(model.module.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(local(weights[n], p, n, cfg))
        loss, grads = _step(model)
        out[name] = (abs(loss - ref_loss), ref_loss, {
            n: ((g - local(ref_grads[n], params[n], n, cfg)).abs().max().item(),
                ref_grads[n].abs().max().item()) for n, g in grads.items()})
    return out


def _table_problems(model, cfg, record) -> list[str]:
    """Differences between this rank's built parameters and the family's table."""
    from recipes.families import parameter_shapes
    from recipes.model.shapes import local_shape, padded_vocab_size

    tp, g = record["tensor_model_parallel_size"], record["gtp_remat_size"]
    vocab = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by, tp)
    want = {p.name: local_shape(p, tp, g, record["pad_for_alignment"])[0]
            for p in parameter_shapes(cfg.model, vocab)}
    module = getattr(model.module, "module", model.module)  # bf16: inside Float16Module
    got = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return [f"{n}: built {got.get(n)}, table {want.get(n)}" for n in sorted(got.keys() | want.keys())
            if got.get(n) != want.get(n)]


def _pairs(root: str, cfgs: dict) -> dict:
    """In the order of ``cfgs``: build a layout, check its parameter table (without pipeline
    stages), load into it every save made so far (sentinel first), then fill it with the goldens
    and save it; finally the first layout again loads every save. Each pair of layouts is loaded
    in one direction, every save at the first layout (one build a layout, and one more). A
    stock-format layout loads nothing (megatron's own loader reads only its own layout)."""
    from pathlib import Path

    from ckpt import io as checkpoint

    out = {"filled": {}, "loads": {}, "table": {}, "stock": {}}

    def load(source, name, model, opt, sched, record, cfg):
        golden_fill(model, opt, cfg, sentinel=True)
        checkpoint.load_checkpoint(Path(root) / source, model, opt, sched, record)
        out["loads"][(source, name)] = golden_check(model, opt, cfg)

    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        if record["pipeline_model_parallel_size"] == 1:
            out["table"][name] = _table_problems(model, cfg, record)
        for source in out["filled"] if cfg.checkpoint.format == "logical" else ():
            load(source, name, model, opt, sched, record, cfg)
        out["filled"][name] = golden_fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
        if cfg.checkpoint.format == "stock":  # what megatron's padded writer stored
            from ckpt.stock import analyze

            out["stock"][name] = {k: (t.stored_shape, t.logical_shape, t.stock)
                                  for k, t in analyze(Path(root) / name).tensors.items()
                                  if k.endswith("linear_qkv.weight")}
    first = next(iter(cfgs))
    model, opt, sched, record, cfg = build(cfgs[first])
    for source in cfgs:
        load(source, first, model, opt, sched, record, cfg)
    return out


def _world(models: dict) -> dict:
    """``{model: its results}`` for each ``model: (root, tp1 config, compared, saved)``."""
    out = {}
    for model, (root, ref, compared, saved) in models.items():
        t0 = time.time()
        res = {"compared": _compare(ref, compared)}
        t1 = time.time()
        res.update(_pairs(root, saved))
        res["seconds"] = (t1 - t0, time.time() - t1)
        out[model] = res
    return out


# model: (overrides, compared layouts, saved layouts, parameters with a gradient)
MODELS = {"MLA": (MLA, COMPARED, SAVED, 25), "gated": (GATED, GATED_COMPARED, GATED_SAVED, 15)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    models = {}
    for model, (overrides, compared, saved, _) in MODELS.items():
        models[model] = (
            str(tmp_path_factory.mktemp(model)),
            make_cfg(MODEL, 1, 1, None, WORLD, "logical", *overrides),
            {name: make_cfg(MODEL, tp, g, pad, WORLD, "logical", *overrides, *extra)
             for name, (tp, g, pad, extra) in compared.items()},
            {name: make_cfg(MODEL, tp, g, pad, WORLD, "stock" if _STOCK in extra else "logical",
                            *overrides, "precision=bf16", *(e for e in extra if e != _STOCK))
             for name, (tp, g, pad, extra) in saved.items()})
    results = run_distributed(_world, WORLD, models, timeout=600)
    for model, res in results[0].items():
        print(f"\n{model} world: forward/backward {res['seconds'][0]:.1f}s, checkpoints "
              f"{res['seconds'][1]:.1f}s")
    return results


@pytest.fixture(params=list(MODELS))
def world(worlds, request):
    """``(model, each rank's results for it)``."""
    return request.param, [res[request.param] for res in worlds]


def _parameter_count(model: str) -> int:
    from compose import make_cfg as compose_cfg

    from recipes.families import parameter_counts

    return parameter_counts(compose_cfg(f"model={MODEL}", *MODELS[model][0]).model, 320)[0]


def test_forward_and_backward_equal_tp1_at_tp_and_gtp_layouts(world):
    """Loss and every gradient (main_grad after megatron's finalize_model_grads) within
    ``fp32_rtol(1, parameters)`` of tp1's, relative to the loss and to each tp1 gradient's
    largest element, on every rank."""
    model, world = world
    _, compared, _, n_grads = MODELS[model]
    rtol = fp32_rtol(1, _parameter_count(model))
    problems = []
    for rank, res in enumerate(world):
        assert set(res["compared"]) == set(compared)
        for name, (dloss, loss, grads) in res["compared"].items():
            assert len(grads) == n_grads, (name, sorted(grads))
            if dloss > rtol * abs(loss):
                problems.append(f"rank {rank} {name}: loss differs by {dloss:g} (bound "
                                f"{rtol * abs(loss):g})")
            problems += [f"rank {rank} {name} {n}: max |grad - tp1's| {d:g} > {rtol:g} x {m:g}"
                         for n, (d, m) in sorted(grads.items()) if not d <= rtol * m]
    assert not problems, "\n".join(problems[:20])


def test_the_parameter_table_is_the_built_model_at_every_layout(world):
    model, world = world
    saved = MODELS[model][2]
    for rank, res in enumerate(world):
        assert set(res["table"]) == {n for n, lay in saved.items() if _PP2 not in lay[3]}
        for name, problems in res["table"].items():
            assert not problems, (rank, name, problems[:6])


def test_every_layout_pair_restores_weights_main_params_and_moments_exactly(world):
    """Each pair of SAVED in one direction (the later layout reads the earlier's save), and
    every save read at tp1: bf16 weights, fp32 main params, exp_avg, exp_avg_sq and step."""
    model, world = world
    saved = MODELS[model][2]
    names = list(saved)
    pairs = {(s, d) for i, d in enumerate(names) for s in names[:i] if _STOCK not in saved[d][3]}
    for res in world:
        assert set(res["loads"]) == pairs | {(s, names[0]) for s in names}
    # The stock save holds megatron's padded rows (60 a TP rank padded to 64), read as 120:
    # the weight, its fp32 main param and both moments.
    assert set(world[0]["stock"]) == {n for n, lay in saved.items() if _STOCK in lay[3]}
    for qkv in world[0]["stock"].values():
        assert "decoder.layers.self_attention.linear_qkv.weight" in qkv and len(qkv) == 4, qkv
        assert set(qkv.values()) == {((2, 128, 72), (2, 120, 72), True)}, qkv
    problems = pair_problems(world)
    assert not problems, "\n".join(problems[:30])
    # The distributed optimizer's ranks each hold part of the state.
    for name in {"pp2dp2do", "g2a16dp2do"} & set(names):
        assert all(r["filled"][name] > 0 for r in world), name
