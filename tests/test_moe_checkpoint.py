"""MoE-era layout records and checkpoints written before them (no processes); MoE resumes
across expert layouts (in-world training jobs), and the Hugging Face export of their checkpoints."""

from __future__ import annotations

import pytest
import torch
from compose import make_cfg

from ckpt.format.records import LAYOUT_KEY, saved_layout, stored_layout
from recipes.config.validate import validate

# The keys part 1 of the MoE work added to every layout record.
NEW_KEYS = ("sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
            "expert_gtp_remat_size", "context_parallel_size")


@pytest.mark.parametrize("overrides", [("parallelism=tp2",), ("parallelism=tp1",)])
def test_a_record_from_before_the_expert_keys_is_the_same_layout(overrides):
    from ckpt.io import layout_record

    now = layout_record(validate(make_cfg(*overrides), 2))
    old = {k: v for k, v in stored_layout(now).items() if k not in NEW_KEYS}
    assert len(old) == len(stored_layout(now)) - len(NEW_KEYS)
    back = saved_layout({LAYOUT_KEY: old})
    # pad_for_alignment comes from the sharding record (absent here): compare the rest.
    assert {k: v for k, v in back.items()} == {k: v for k, v in now.items()
                                               if k != "pad_for_alignment"}


def test_a_record_with_the_expert_keys_keeps_them():
    from ckpt.io import layout_record

    now = layout_record(validate(make_cfg("model=moe_tiny", "parallelism=tp2",
                                          "parallelism.sequence_parallel=true",
                                          "parallelism.expert_tensor_parallel_size=1"), 2))
    back = saved_layout({LAYOUT_KEY: stored_layout(now)})
    assert back["sequence_parallel"] is True and back["expert_tensor_parallel_size"] == 1


# --------------------------------------------------------------------------------------------
# Training jobs (in-world, as torchrun ranks run them): moe_tiny (4 SwiGLU experts of width 100, hidden 72, 2 layers, fp32, Adam).
# A: ep2 x egtp2/a16 on 4 processes, 10 iterations uninterrupted, saving every 3 (expert fc1 200
#    rows per expert, 224 padded under a16; a dense and an expert optimizer);
# E: ep1 x egtp2/a16 with megatron's distributed optimizer on 4 processes (expert data parallel
#    2 shards the expert optimizer state), from A's iteration 3 to 6;
# B: tp1 on 1 process, no GTP, from A's iteration 3 to 6 (one optimizer), saving 6 (E and B
#    stop 3 iterations after the resume, their decay pinned to A's 10 iterations);
# C: tp2+sp x ep2 (etp1) on 2 processes, from B's iteration 6 to 10 (dense and expert optimizers
#    again), saving every iteration;
# D: pp2 x ep2 with megatron's distributed optimizer on 4 processes (dense data parallel 2,
#    expert data parallel 1), from C's iteration 7 to 10: plain -> distributed optimizer, and
#    megatron's distributed-optimizer load through untie_steps (a step shared by every param
#    would bias-correct wrongly from the second iteration after the load on).
# DeepSeek-V3-style routing (DEEPSEEK: a dense first layer, 8 experts, sigmoid scores with the
# aux-loss-free expert bias, 4 groups of which a token picks 2, a shared expert), in A's world:
# F: ep2 x egtp2/a16 on 4 processes, 6 iterations uninterrupted, saving every 3;
# G: F's layout, from F's iteration 3 to 6 (bit for bit: the same computation);
# H: ep4 with megatron's distributed optimizer, from F's iteration 3 to 6 (within the bound).
# Exactness of every expert tensor at each layout pair: test_moe_checkpoint_layouts.py.
# --------------------------------------------------------------------------------------------
MOE = ("model=moe_tiny", "parallelism=tp1", "train.eval_iters=0", "logger=none",
       "optim.lr_warmup_iters=1", "train.train_iters=10", "checkpoint.save_interval=3")
A_LAYOUT = ("parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
            "gtp.pad_for_alignment=16", "parallelism.nproc_per_node=4")
C_LAYOUT = ("parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
            "parallelism.expert_model_parallel_size=2", "parallelism.expert_tensor_parallel_size=1",
            "parallelism.nproc_per_node=2")
E_LAYOUT = ("gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16",
            "optim.use_distributed_optimizer=true", "parallelism.nproc_per_node=4")
DEEPSEEK = ("model.num_moe_experts=8", "model.moe_layer_freq=[0,1]",
            "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
            "model.moe_router_num_groups=4", "model.moe_router_group_topk=2",
            "model.moe_router_topk_scaling_factor=2.5",
            "model.moe_shared_expert_intermediate_size=64",
            "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_aux_loss_coeff=0.0001",
            "train.train_iters=6")
H_LAYOUT = ("parallelism.expert_model_parallel_size=4", "optim.use_distributed_optimizer=true",
            "parallelism.nproc_per_node=4")
D_LAYOUT = ("parallelism.pipeline_model_parallel_size=2",
            "parallelism.expert_model_parallel_size=2", "optim.use_distributed_optimizer=true",
            "parallelism.nproc_per_node=4")


@pytest.fixture(scope="module")
def moe_runs(train_jobs, tmp_path_factory):
    # In-world jobs (tests/helpers/inworld.py): one world per link, as its world size differs.
    root = tmp_path_factory.mktemp("moe_resume")
    a, b, c, d, e, f, g, h = (root / name for name in "abcdefgh")
    train_jobs([
        (a, [*MOE, *A_LAYOUT]),
        (e, [*MOE, *E_LAYOUT, f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=3",
             "checkpoint.save=null", "train.train_iters=6", "optim.lr_decay_iters=10"]),
        (f, [*MOE, *A_LAYOUT, *DEEPSEEK]),
        (g, [*MOE, *A_LAYOUT, *DEEPSEEK, f"checkpoint.load={f}/checkpoints",
             "checkpoint.load_iteration=3"]),
        (h, [*MOE, *H_LAYOUT, *DEEPSEEK, f"checkpoint.load={f}/checkpoints",
             "checkpoint.load_iteration=3"]),
        (b, [*MOE, "parallelism.nproc_per_node=1", f"checkpoint.load={a}/checkpoints",
             "checkpoint.load_iteration=3", "train.train_iters=6",
             "optim.lr_decay_iters=10"]),
        (c, [*MOE, *C_LAYOUT, f"checkpoint.load={b}/checkpoints",
             "checkpoint.load_iteration=6", "checkpoint.save_interval=1"]),
        (d, [*MOE, *D_LAYOUT, f"checkpoint.load={c}/checkpoints",
             "checkpoint.load_iteration=7"]),
    ])
    return a, b, c, d, e, f, g, h


@pytest.mark.e2e
def test_moe_resumes_across_expert_layouts(moe_runs):
    from resume_checks import assert_same_step, by_iteration
    from tolerance import MOE_TINY

    a, b, c, d, e = (by_iteration(run)[0] for run in moe_runs[:5])
    assert sorted(a) == list(range(1, 11)) and sorted(b) == list(range(4, 7))
    assert sorted(c) == list(range(7, 11)) and sorted(d) == list(range(8, 11))
    # b, c and d all left a's bits at b's resume from a's iteration 3: it - 3 steps apart.
    for it in range(4, 7):  # ep2 x egtp2/a16 -> tp1, no GTP: 3 iterations after the resume
        assert_same_step(b[it], a[it], steps=it - 3, terms=MOE_TINY)
    assert sorted(e) == list(range(4, 7))
    for it in range(4, 7):  # -> egtp2/a16 with the distributed optimizer (issue 36)
        assert_same_step(e[it], a[it], steps=it - 3, terms=MOE_TINY)
    for it in range(7, 11):  # tp1 -> tp2+sp x ep2: 4 iterations
        assert_same_step(c[it], a[it], steps=it - 3, terms=MOE_TINY)
    for it in range(8, 11):  # tp2+sp x ep2 -> pp2 x ep2 + distributed optimizer: 3 iterations
        assert_same_step(d[it], a[it], steps=it - 3, terms=MOE_TINY)


def _expert_bias(run_dir, iteration: int) -> torch.Tensor:
    """The stored ``expert_bias`` of layer 1 (the MoE one) of ``run_dir``'s checkpoint."""
    import torch.distributed.checkpoint as dcp

    out = {"decoder.layers.1.mlp.router.expert_bias": torch.full((8,), -999.0)}
    reader = dcp.FileSystemReader(str(run_dir / "checkpoints" / f"iter_{iteration:07d}"))
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out["decoder.layers.1.mlp.router.expert_bias"]


@pytest.mark.e2e
def test_deepseek_routing_resumes_with_its_expert_bias(moe_runs):
    """DeepSeek-style routing (F, G, H above): the resume at F's layout (G) equals F bit for bit
    over 3 iterations, the tokens-per-expert figures of layer 1 included (the chart goes on
    from iteration 4: no reset, no repeated iteration), and stores F's expert bias exactly; the
    resume at ep4 with the distributed optimizer (H) is within the bound, its expert bias
    within a re-routed token's sign flips of F's."""
    from resume_checks import (EXACT_KEYS, assert_bit_for_bit, assert_same_step, by_iteration,
                               resumed_rows)
    from tolerance import MOE_TINY

    from recipes.metrics.experts import metric_names

    f_dir, g_dir, h_dir = moe_runs[5:]
    f = by_iteration(f_dir)[0]
    g = resumed_rows(g_dir, 3, iterations=(4, 5, 6))
    h = resumed_rows(h_dir, 3, iterations=(4, 5, 6))
    tokens = metric_names(1)
    assert sorted(f) == list(range(1, 7))
    for it in range(1, 7):  # layer 0 is dense: no figures; layer 1 routes every iteration
        assert not set(metric_names(0)) & set(f[it]) and set(tokens) <= set(f[it]), f[it]
    assert_bit_for_bit(g, f, range(4, 7), keys=(*EXACT_KEYS, "seq_load_balancing_loss",
                                                *tokens), got_dir=g_dir, want_dir=f_dir)
    per_flip = 1 / (16 * 64 * 2 / 8)  # one token of the mean count (global batch x seq x top-k)
    for it in range(4, 7):  # ep2 x egtp2/a16 -> ep4 + distributed optimizer: it - 3 steps
        assert_same_step(h[it], f[it], steps=it - 3, terms=MOE_TINY)
        # another rounding of the router logits may re-route a near-tie token
        assert all(abs(h[it][k] - f[it][k]) <= 2 * per_flip for k in tokens), (it, h[it], f[it])
    # One step moves each bias entry by -rate, 0 or +rate: after 6 steps all are multiples of
    # it, and the experts were not balanced from the start (some entry moved).
    rate = 1e-3
    bias = _expert_bias(f_dir, 6)
    assert bias.abs().max() > 0 and bias.abs().max() <= 6 * rate * (1 + 1e-6), bias
    # same computation: G resumes F at its layout (assert_bit_for_bit checked both configs)
    assert torch.equal(_expert_bias(g_dir, 6), bias)
    # Another layout may re-route a near-tie token; a sign flip moves an entry by 2 * rate.
    assert (_expert_bias(h_dir, 6) - bias).abs().max() <= 2 * rate * (1 + 1e-6)


@pytest.mark.e2e
def test_expert_weights_and_moments_are_stored_in_the_logical_layout(moe_runs):
    """Discriminating: stock megatron-core 0.19.2 stores an expert-GTP weight over its padded
    rows (fc1 224 of 200 per expert at a16, fc2 96 of 72) and marks it allow_shape_mismatch."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(moe_runs[0] / "checkpoints" / "iter_0000003")).read_metadata()
    sizes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}
    # (layers, experts, rows, columns): fc1 [gate | up] 2 x 100 rows, fc2 72 rows of 100.
    want = {"linear_fc1.weight": (2, 4, 200, 72), "linear_fc2.weight": (2, 4, 72, 100)}
    for name, shape in want.items():
        for prefix in ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
            key = f"{prefix}decoder.layers.mlp.experts.experts.{name}"
            assert sizes.get(key) == shape, (key, sizes.get(key), sorted(sizes)[:40])


# --------------------------------------------------------------------------------------------
# Hugging Face export (recipes/families/moe/formats.py). A's iteration-9 checkpoint (ep2 x
# egtp2/a16, 4 processes, through train.py) -> MixtralForCausalLM; a moe_tiny with qk_layernorm
# saved at tp1 -> Qwen3MoeForCausalLM. megatron's logits come from one process at tp1/ep1 without GTP that
# loads the checkpoint (ckpt.io.load_model_weights), not from the exported files.
# --------------------------------------------------------------------------------------------
VOCAB = 257  # the byte tokenizer; moe_tiny pads it to 320 rows
EXPORT_ATOL = 1e-4  # fp32; the bound
TOKENS_SEED = 11


def _ep1_cfg(*overrides: str) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(make_cfg("model=moe_tiny", "parallelism=tp1",
                                      "parallelism.nproc_per_node=1", *overrides))


def _megatron_logits(jobs: list, tokens):
    """One process, each job in turn: ``("load", cfg, ckpt)`` loads ``ckpt``'s weights into the
    tp1/ep1 model of ``cfg``; ``("save", cfg, root)`` gives every norm weight a value away from 1
    (a misplaced or swapped norm then shows) and saves the model at iteration 1. Returns the
    logits of ``tokens`` (eval mode) after each job."""
    from multiproc import reset_model_parallel
    from omegaconf import OmegaConf

    from ckpt import io as checkpoint
    from recipes.run import worker
    from ckpt.io.load import load_model_weights

    out = []
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    for kind, cfg_yaml, path in jobs:
        reset_model_parallel()
        cfg = OmegaConf.create(cfg_yaml)
        parallel_dims = validate(cfg, 1)
        _, model, optimizer, scheduler = worker.setup(cfg, parallel_dims)
        if kind == "load":
            load_model_weights(path, model)
        else:
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            common = {"consumed_samples": 0, "config": OmegaConf.to_container(cfg)}
            checkpoint.save_checkpoint(path, 1, model, optimizer, scheduler, common,
                                       checkpoint.layout_record(parallel_dims))
        model.eval()
        with torch.no_grad():
            out.append(model(tokens, positions, None))
    return out


@pytest.fixture(scope="module")
def exported(moe_runs, tmp_path_factory):
    """``{name: (hf dir, megatron logits)}`` for ``mixtral`` (A's iteration 9) and ``qwen3_moe``."""
    from multiproc import run_distributed

    from ckpt import cli

    root = tmp_path_factory.mktemp("moe_export")
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(TOKENS_SEED))
    a_ckpt = moe_runs[0] / "checkpoints" / "iter_0000009"
    jobs = [("load", _ep1_cfg(), str(a_ckpt)),
            ("save", _ep1_cfg("model.qk_layernorm=true"), str(root / "qwen"))]
    mixtral, qwen = run_distributed(_megatron_logits, 1, jobs, tokens, timeout=600)[0]
    out = {}
    for name, src, logits in (("mixtral", a_ckpt, mixtral), ("qwen3_moe", root / "qwen", qwen)):
        assert cli.main(["export", str(src), str(root / f"hf_{name}")]) == 0
        out[name] = (root / f"hf_{name}", logits)
    return tokens, out


@pytest.mark.e2e
@pytest.mark.parametrize("name,cls", [("mixtral", "MixtralForCausalLM"),
                                      ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_moe_export_logits_equal_megatron(exported, name, cls):
    """The exported model, loaded by transformers (fp32, CPU), gives megatron's logits on the
    same tokens (padded vocabulary rows dropped), and routes like megatron (renormalised top-2)."""
    import json

    import transformers

    tokens, out = exported
    hf_dir, megatron = out[name]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [cls] and config["num_experts_per_tok"] == 2
    assert config.get("num_local_experts", config.get("num_experts")) == 4
    if name == "qwen3_moe":
        assert config["norm_topk_prob"] is True and config["moe_intermediate_size"] == 100
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              trust_remote_code=False)
    assert type(model).__name__ == cls
    with torch.no_grad():
        hf = model(tokens).logits
    assert megatron.shape == (2, 64, 320) and hf.shape == (2, 64, VOCAB)
    diff = (hf - megatron[..., :VOCAB]).abs().max().item()
    assert diff <= EXPORT_ATOL, (name, diff)
