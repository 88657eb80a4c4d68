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
* dense ``tp2`` with sequence parallelism computes what ``tp2`` without it does (the norm's
  ``sequence_parallel`` tag of ``mcore_compat.moe_cpu`` included: without it the norm gradients,
  hence the grad norm, differ), and the iterations after Adam steps agree too.

Every layout reads the same global batch (one synthetic micro-batch per data-parallel rank and
step) from the same initial weights (CPU initialization; experts: ``recipes.families.moe.model.init_experts``).
"""

from __future__ import annotations

import pytest
from compose import make_cfg
from multiproc import run_distributed
from omegaconf import OmegaConf
from tolerance import HYBRID_MOE_TINY, LLAMA_TINY, MOE_TINY, assert_fp32_close

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


def _run(cfg_dict, broken):
    """``STEPS`` train steps at ``cfg_dict``'s layout; ``broken``: the gtp.expert_grads fix switched
    off (a no-op in its place) or None. Returns [(lm loss, grad-norm)] per step."""
    import torch
    from megatron.core import parallel_state

    from gtp import expert_grads
    from multiproc import reset_model_parallel
    from recipes.run.loop import train_step
    from recipes.config.validate import validate
    from recipes.run.worker import setup

    cfg = OmegaConf.create(cfg_dict)
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    original = getattr(expert_grads, broken) if broken else None
    if broken:
        setattr(expert_grads, broken, lambda *a, **k: 0)
    try:
        _, model, optimizer, scheduler = setup(cfg, parallel_dims)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_rank, dp_size = group.rank(), group.size()
        out = []
        for step in range(STEPS):
            batches = _batches(cfg, dp_rank, dp_size, step)
            m = train_step(model, optimizer, scheduler, iter(batches), len(batches), cfg)
            out.append((m["lm loss"], m["grad-norm"]))
        return out
    finally:
        if broken:
            setattr(expert_grads, broken, original)
        reset_model_parallel()


def _world(cases):
    return {name: _run(cfg, broken) for name, (cfg, broken) in cases.items()}


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
        "dense tp2": (_cfg("model=llama_tiny", "parallelism=tp2"), None),
        "dense tp2+sp": (_cfg("model=llama_tiny", "parallelism=tp2",
                              "parallelism.sequence_parallel=true"), None),
    }
    return run_distributed(_world, 2, cases, timeout=600)[0]


@pytest.fixture(scope="module")
def results4():
    """Expert GTP over expert parallelism (4 processes): the layout Megatron-LM #7165 found
    expert gradients mis-scaled at (expert and dense GTP degrees differ: 2 and 1)."""
    cases = {"moe ep2 egtp2": (_cfg("model=moe_tiny", "gtp.expert_gtp_remat_size=2",
                                    "gtp.pad_for_alignment=16", "parallelism=tp1",
                                    "parallelism.expert_model_parallel_size=2",
                                    "parallelism.nproc_per_node=4"), None)}
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


def test_sequence_parallel_changes_no_math(results):
    pairs = zip(results["dense tp2+sp"], results["dense tp2"])
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(pairs, 1):  # `step` from one init
        assert_fp32_close(loss, ref_loss, step, LLAMA_TINY, what=(step, "loss"))
        assert_fp32_close(gn, ref_gn, step, LLAMA_TINY, what=(step, "grad norm"))
