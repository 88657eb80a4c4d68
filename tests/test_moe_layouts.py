"""Layouts in a 2-process and a 4-process gloo world, through the worker's own setup
(``recipes.run.worker.setup``: process groups, CPU shims, model, DDP, optimizer) and train step
(``recipes.run.loop.train_step``), 3 steps each:

* expert GTP computes what ep1 without GTP does (``lm loss`` and ``grad-norm``), with the dense
  and expert GTP degrees equal (egtp2) or not (g2 x egtp1; ep2 x egtp2 with dense GTP off:
  where Megatron-LM #7165 found expert gradients mis-scaled; g2 x ep2 without expert GTP, where
  megatron's expert buckets' scale missed the dense GTP factor: expert gradients doubled);
* each expert-GTP gradient fix of ``gtp.expert_grads``, switched off in turn, moves the first
  step's ``grad-norm`` away from the same model without expert GTP (the fixes are needed);
* a hybrid stack's MoE layers (``model=hybrid_moe_tiny``: Mamba, MoE, attention, MoE; sigmoid
  routing with the expert bias, a shared expert) at ep2, expert TP 2 and expert GTP 2 compute
  what they do at ep1, and so does the stack over two pipeline stages;
* hybrid stacks at tp2 with sequence parallelism (``hybrid_moe_tiny``: Mamba and MoE layers,
  experts at expert TP 2; ``qwen3_next_tiny``: GatedDeltaNet, gated attention with q/k norms, at
  ep2 with the distributed optimizer; 4 processes: with dense and expert GTP 2, and over two
  pipeline stages), started from the weights the model has at tp1, compute what tp1 does:
  ``lm loss`` and ``grad-norm`` over 3 steps, and every parameter's first gradient (a norm
  whose gradient is not summed over TP, or summed twice, moves its own by 9e-4 to 1e-2 of the
  whole gradient's norm, where the bound is 4e-5);
* dense ``tp2`` with sequence parallelism computes what ``tp2`` without it does (the norm's
  ``sequence_parallel`` tag of ``mcore_compat.moe_cpu`` included: without it the norm gradients,
  hence the grad norm, differ), and the iterations after Adam steps agree too.

Every layout reads the same global batch (one synthetic micro-batch per data-parallel rank and
step) from the same initial weights (CPU initialization; experts:
``recipes.families.moe.model.init_experts``; at tp > 1 for hybrid stacks: the tp1 model's, cut to
each rank).
"""

from __future__ import annotations

import pytest
from compose import make_cfg
from multiproc import run_distributed
from omegaconf import OmegaConf
from tolerance import (HYBRID_MOE_TINY, LLAMA_TINY, MOE_TINY, QWEN3_NEXT_TINY, assert_fp32_close,
                       fp32_rtol)

COMMON = ("checkpoint=none", "logger=none", "optim.lr_warmup_iters=0", "train.train_iters=2",
          "data.micro_batch_size=2", "data.global_batch_size=8")


def _batches(cfg, dp_rank, dp_size, step):
    import torch

    n = cfg.data.global_batch_size // cfg.data.micro_batch_size // dp_size
    s, b = cfg.model.seq_length, cfg.data.micro_batch_size
    out = []
    for j in range(n):
        g = torch.Generator().manual_seed(1000 * step + dp_rank * n + j)
        tokens = torch.randint(0, 257, (b, s + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "position_ids": torch.arange(s).expand(b, s).contiguous(),
                    "loss_mask": torch.ones(b, s)})
    return out


STEPS = 3
FROM_TP1 = "from tp1"


def _tp1_reference(cfg_dict):
    """``cfg_dict``'s model built at tp1 without GTP (every rank a data-parallel replica), its
    first step trained: ``({global name: initial weight}, {global name: step-1 gradient})``,
    full tensors. The weights a tp > 1 layout starts from, where megatron's Mamba and
    GatedDeltaNet draw their TP-split ``conv1d``, ``dt_bias``, ``A_log`` and ``D`` per TP rank."""
    import torch
    from megatron.core import parallel_state

    from layout_goldens import global_names
    from multiproc import reset_model_parallel
    from recipes.config.validate import validate
    from recipes.run.loop import train_step
    from recipes.run.worker import setup

    cfg = OmegaConf.create(cfg_dict)
    par = cfg.parallelism
    par.tensor_model_parallel_size = par.pipeline_model_parallel_size = 1
    par.expert_model_parallel_size = par.expert_tensor_parallel_size = 1
    par.sequence_parallel, par.data_parallel_size = False, None
    cfg.gtp.gtp_remat_size = cfg.gtp.expert_gtp_remat_size = 1
    cfg.optim.use_distributed_optimizer = False
    try:
        parallel_dims = validate(cfg, torch.distributed.get_world_size())
        _, model, optimizer, scheduler = setup(cfg, parallel_dims)
        names = global_names(model).values()
        weights = {name: p.detach().clone() for name, p in names}
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        batches = _batches(cfg, group.rank(), group.size(), 0)
        train_step(model, optimizer, scheduler, iter(batches), len(batches), cfg)
        return weights, {name: p.main_grad.detach().clone() for name, p in names}
    finally:
        reset_model_parallel()


def _start_from(model, optimizer, cfg, full) -> None:
    """Each parameter set to this rank's piece of the tp1 tensor ``full[global name]``
    (``layout_goldens.local``: TP chunk, packed components one by one, GTP shard)."""
    import torch

    from layout_goldens import global_names, local

    with torch.no_grad():
        for name, p in global_names(model).values():
            p.copy_(local(full[name], p, name, cfg))
    optimizer.reload_model_params()


def _grad_differences(model, cfg, ref) -> dict:
    """``{global name: |g - g_tp1| / |G_tp1|}`` for every tp1 parameter over every rank's pieces
    (the largest where ranks share one; infinity where no rank holds it): the step-1 gradient
    after ``finalize_model_grads`` (DP, TP and GTP sums) against this rank's piece of the tp1
    one, relative to the norm of tp1's whole gradient (the grad-norm: its rounding bound covers
    every part of the vector)."""
    import math

    import torch

    from layout_goldens import global_names, local

    total = math.sqrt(sum(t.double().square().sum().item() for t in ref.values()))
    out = {name: (p.main_grad - local(ref[name], p, name, cfg)).norm().item() / total
           for name, p in global_names(model).values()}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, out)
    # A tp1 parameter no rank holds: infinitely far.
    return {name: max((d[name] for d in every if name in d), default=math.inf) for name in ref}


def _run(cfg_dict, broken, grads=None):
    """``STEPS`` train steps at ``cfg_dict``'s layout; ``broken``: the gtp.expert_grads fix switched
    off (a no-op in its place), ``"from tp1"`` (start from the weights of the model built at tp1,
    :func:`_tp1_reference`; ``grads`` gets :func:`_grad_differences` after step 1) or None.
    Returns [(lm loss, grad-norm)] per step."""
    import torch
    from megatron.core import parallel_state

    from gtp import expert_grads
    from multiproc import reset_model_parallel
    from recipes.run.loop import train_step
    from recipes.config.validate import validate
    from recipes.run.worker import setup

    full, ref = _tp1_reference(cfg_dict) if broken == FROM_TP1 else (None, None)
    broken = None if broken == FROM_TP1 else broken
    cfg = OmegaConf.create(cfg_dict)
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    original = getattr(expert_grads, broken) if broken else None
    if broken:
        setattr(expert_grads, broken, lambda *a, **k: 0)
    try:
        _, model, optimizer, scheduler = setup(cfg, parallel_dims)
        if full is not None:
            _start_from(model, optimizer, cfg, full)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_rank, dp_size = group.rank(), group.size()
        out = []
        for step in range(STEPS):
            batches = _batches(cfg, dp_rank, dp_size, step)
            m = train_step(model, optimizer, scheduler, iter(batches), len(batches), cfg)
            out.append((m["lm loss"], m["grad-norm"]))
            if step == 0 and ref is not None:
                grads.update(_grad_differences(model, cfg, ref))
        return out
    finally:
        if broken:
            setattr(expert_grads, broken, original)
        reset_model_parallel()


def _world(cases):
    """``{name: _run(...)}``; a case started from tp1's weights adds ``"<name>, grads"``."""
    out = {}
    for name, (cfg, broken) in cases.items():
        grads = {}
        out[name] = _run(cfg, broken, grads)
        if grads:
            out[f"{name}, grads"] = grads
    return out


def _cfg(*overrides):
    return OmegaConf.to_container(make_cfg(*COMMON, *overrides), resolve=True)


HYBRID = ("model=hybrid_moe_tiny", "parallelism=tp1", "parallelism.nproc_per_node=2")
HYBRID_CASES = {
    "ep1": (),
    "ep2": ("parallelism.expert_model_parallel_size=2",),
    "etp2": ("parallelism.expert_tensor_parallel_size=2",),
    "egtp2": ("gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
    # Stage 1 ("*E") starts from pp1's weights only if the draws of "ME" before it are replayed.
    "pp2": ("parallelism.pipeline_model_parallel_size=2",),
}
SP = ("parallelism=tp2", "parallelism.sequence_parallel=true")
QWEN3 = "model=qwen3_next_tiny"
# Hybrid stacks at tp2 with sequence parallelism, from the tp1 weights (FROM_TP1): 2 processes
# (hybrid_moe_tiny: Mamba, MoE layers with expert TP 2 (etp follows tp); Qwen3-Next:
# GatedDeltaNet, gated attention with q/k norms, shared-expert gate, at ep2 with the
# distributed optimizer) and 4 processes (dense and expert GTP 2; two pipeline stages).
HYBRID_SP_CASES = {
    "hybrid tp2+sp": ("model=hybrid_moe_tiny", *SP),
    "qwen3 tp2+sp ep2 do": (QWEN3, *SP, "parallelism.expert_model_parallel_size=2",
                            "parallelism.expert_tensor_parallel_size=1",
                            "optim.use_distributed_optimizer=true"),
}
HYBRID_SP4_CASES = {
    "hybrid tp2+sp g2a16 egtp2": ("model=hybrid_moe_tiny", *SP, "gtp.gtp_remat_size=2",
                                  "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
    "qwen3 tp2+sp pp2": (QWEN3, *SP, "parallelism.pipeline_model_parallel_size=2"),
}


@pytest.fixture(scope="module")
def results():
    egtp = ("model=moe_tiny", "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16",
            "parallelism=tp1", "parallelism.nproc_per_node=2")
    cases = {
        "moe ep1": (_cfg("model=moe_tiny", "parallelism=tp1", "parallelism.nproc_per_node=2"), None),
        "moe egtp2": (_cfg(*egtp), None),
        # Dense GTP without expert GTP: the dense weights sharded, the experts whole.
        "moe g2 egtp1": (_cfg("model=moe_tiny", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
                              "parallelism=tp1", "parallelism.nproc_per_node=2"), None),
        # Dense GTP over expert parallelism: the experts in their own buckets, not GTP-sharded.
        "moe g2 ep2": (_cfg("model=moe_tiny", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
                            "parallelism=tp1", "parallelism.expert_model_parallel_size=2",
                            "parallelism.nproc_per_node=2"), None),
        "moe egtp2, no expert tag": (_cfg(*egtp), "tag_expert_params"),
        "moe egtp2, no expert scale": (_cfg(*egtp), "scale_expert_gradients"),
        **{f"hybrid {name}": (_cfg(*HYBRID, *extra), None) for name, extra in HYBRID_CASES.items()},
        "qwen3 tp1": (_cfg(QWEN3, "parallelism=tp1", "parallelism.nproc_per_node=2"), None),
        **{name: (_cfg(*extra), FROM_TP1) for name, extra in HYBRID_SP_CASES.items()},
        "dense tp2": (_cfg("model=llama_tiny", "parallelism=tp2"), None),
        "dense tp2+sp": (_cfg("model=llama_tiny", "parallelism=tp2",
                              "parallelism.sequence_parallel=true"), None),
    }
    return run_distributed(_world, 2, cases, timeout=600)[0]


@pytest.fixture(scope="module")
def results4():
    """Expert GTP over expert parallelism (4 processes): the layout Megatron-LM #7165 found
    expert gradients mis-scaled at (expert and dense GTP degrees differ: 2 and 1); hybrid
    stacks at tp2 with sequence parallelism over GTP or pipeline stages."""
    cases = {"moe ep2 egtp2": (_cfg("model=moe_tiny", "gtp.expert_gtp_remat_size=2",
                                    "gtp.pad_for_alignment=16", "parallelism=tp1",
                                    "parallelism.expert_model_parallel_size=2",
                                    "parallelism.nproc_per_node=4"), None),
             **{name: (_cfg(*extra), FROM_TP1) for name, extra in HYBRID_SP4_CASES.items()}}
    return run_distributed(_world, 4, cases, timeout=600)[0]


@pytest.mark.parametrize("layout", ["moe egtp2", "moe g2 egtp1", "moe ep2 egtp2", "moe g2 ep2"])
def test_expert_gtp_equals_no_gtp(results, results4, layout):
    """``lm loss`` and ``grad-norm`` over 3 steps equal ep1 without GTP (the same global batch:
    micro-batch j of step s is the same whatever rank reads it), with the dense and the expert
    GTP degrees equal (egtp2) and different (g2 x egtp1; ep2 x egtp2 with the dense weights
    whole; g2 x ep2 with the expert weights whole)."""
    pairs = zip({**results, **results4}[layout], results["moe ep1"])
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(pairs, 1):  # `step` from one init
        assert_fp32_close(loss, ref_loss, step, MOE_TINY, what=(step, "loss"))
        assert_fp32_close(gn, ref_gn, step, MOE_TINY, what=(step, "grad norm"))


@pytest.mark.parametrize("broken", ["no expert tag", "no expert scale"])
def test_each_expert_gtp_fix_is_needed(results, broken):
    (loss, gn), ref = results[f"moe egtp2, {broken}"][0], results["moe ep1"][0]
    assert_fp32_close(loss, ref[0], 1, MOE_TINY)  # the forward is right either way
    assert abs(gn - ref[1]) > 1e-3 * ref[1], (broken, gn, ref)


@pytest.mark.parametrize("layout", ["ep2", "etp2", "egtp2", "pp2"])
def test_hybrid_moe_layers_compute_the_same_at_every_expert_layout(results, layout):
    """A hybrid stack's MoE layers: ``lm loss`` and ``grad-norm`` over 3 steps (Adam steps and
    expert-bias updates between them) equal ep1's, experts split by EP, expert TP or expert
    GTP, and the stack split over two pipeline stages (from pp1's initial weights)."""
    pairs = zip(results[f"hybrid {layout}"], results["hybrid ep1"])
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(pairs, 1):  # `step` from one init
        assert_fp32_close(loss, ref_loss, step, HYBRID_MOE_TINY, what=(step, "loss"))
        assert_fp32_close(gn, ref_gn, step, HYBRID_MOE_TINY, what=(step, "grad norm"))


@pytest.mark.parametrize("layout", [*HYBRID_SP_CASES, *HYBRID_SP4_CASES])
def test_hybrid_stacks_at_tp2_with_sequence_parallelism_compute_what_tp1_does(
        results, results4, layout):
    """``lm loss`` and ``grad-norm`` over 3 steps equal tp1's from the same weights, and so does
    every parameter's step-1 gradient (its difference against the whole gradient's norm, the
    grad-norm's bound): every norm
    that sees a sequence shard has its gradient summed over TP (megatron's local norms built
    through ``mcore_compat.moe_cpu``'s ``sequence_parallel`` tag), and the norms that see the
    gathered sequence over TP-split heads are summed once (q/k norms by megatron's
    ``finalize_model_grads``; GatedDeltaNet's ``out_norm`` by ``TPSummedNorm``) or not at all
    (Mamba's gated norm, whose weight TP splits)."""
    qwen3 = layout.startswith("qwen3")
    ref = results["qwen3 tp1" if qwen3 else "hybrid ep1"]
    terms = QWEN3_NEXT_TINY if qwen3 else HYBRID_MOE_TINY
    pairs = zip({**results, **results4}[layout], ref)
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(pairs, 1):  # `step` from one init
        assert_fp32_close(loss, ref_loss, step, terms, what=(step, "loss"))
        assert_fp32_close(gn, ref_gn, step, terms, what=(step, "grad norm"))
    grads = {**results, **results4}[f"{layout}, grads"]
    far = {name: d for name, d in grads.items() if d > fp32_rtol(1, terms)}
    assert not far, far


def test_sequence_parallel_changes_no_math(results):
    pairs = zip(results["dense tp2+sp"], results["dense tp2"])
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(pairs, 1):  # `step` from one init
        assert_fp32_close(loss, ref_loss, step, LLAMA_TINY, what=(step, "loss"))
        assert_fp32_close(gn, ref_gn, step, LLAMA_TINY, what=(step, "grad norm"))
