"""Dry-run figures against Megatron-LM's formulas (theoretical_memory_usage.py) and the paper's.

Goldens are written here from the formulas, not from ``recipes.model.shapes``:
* weights and optimizer: Megatron-LM ``compute_weight_and_optimizer_memory`` (most loaded
  shard at pp 1, untied embeddings; 18 bytes per parameter, 6 + 12 / dp with the distributed
  optimizer), with Llama's RMSNorm (weight only) and the norms held whole on every TP rank;
* activations: Korthikanti et al. 2022, Table 2, "tensor parallel" row (no sequence
  parallelism) for ffn = 4h, plus Megatron-LM's embedding and output-layer terms.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from compose import make_cfg

from recipes.dry_run import activation_bytes, fit_line, rank_sizes, report
from recipes.metrics.logger import format_bytes
from recipes.config.validate import validate

LLAMA3_VOCAB = 128256


def megatron_shard_parameters(L, h, a, groups, ffn, vocab, tp) -> int:
    """Megatron-LM's most-loaded-shard count for a SwiGLU Llama at pp 1, untied embeddings."""
    matrices = 2 * L * h * h * ((1 + groups / a) + ffn / h * 3 / 2)
    embeddings = 2 * h * vocab
    norms = 2 * h * L + h
    per_rank = (matrices + embeddings) / tp + norms
    assert per_rank == int(per_rank)
    return int(per_rank)


LLAMA3 = {
    "llama3_8b_tp4_gtp2_fp8": dict(L=32, h=4096, a=32, groups=8, ffn=14336),
    "llama3_70b_tp8_gtp2_bf16": dict(L=80, h=8192, a=64, groups=8, ffn=28672),
}


@pytest.mark.parametrize("experiment, world, tp", [
    ("llama3_8b_tp4_gtp2_fp8", 32, 4),
    ("llama3_70b_tp8_gtp2_bf16", 128, 8),
])
@pytest.mark.parametrize("distributed", [False, True])
def test_weight_and_optimizer_bytes_follow_megatron(experiment, world, tp, distributed):
    cfg = make_cfg(f"experiment={experiment}", "gtp.gtp_remat_size=1", "train.dry_run=true",
                   f"optim.use_distributed_optimizer={str(distributed).lower()}")
    parallel_dims = validate(cfg, world)
    dp = world // tp
    assert (parallel_dims.tensor_model_parallel_size, parallel_dims.data_parallel_size) == (tp, dp)
    s = rank_sizes(cfg, parallel_dims, LLAMA3_VOCAB)
    n = megatron_shard_parameters(**LLAMA3[experiment], vocab=LLAMA3_VOCAB, tp=tp)
    assert s.parameters == n
    assert (s.param_bytes, s.grad_bytes) == (2 * n, 4 * n)  # bf16 weights, fp32 grad buffer
    if distributed:
        assert s.optimizer_bytes == math.ceil(12 * n / dp)  # 6 + 12 / dp bytes per parameter
    else:
        assert s.param_bytes + s.grad_bytes + s.optimizer_bytes == 18 * n


def test_70b_recipe_at_dp16_shards_its_optimizer_state(monkeypatch):
    """The issue's figure: 49.30 GiB of Adam state per rank without sharding, 3.08 GiB with."""
    cfg = make_cfg("experiment=llama3_70b_tp8_gtp2_bf16", "train.dry_run=true")
    # GTP 2 halves every weight matrix again (no padding at these sizes); norms stay whole.
    shard = megatron_shard_parameters(**LLAMA3["llama3_70b_tp8_gtp2_bf16"],
                                      vocab=LLAMA3_VOCAB, tp=8 * 2)
    for distributed, gib in ((False, 49.30), (True, 3.08)):
        cfg.optim.use_distributed_optimizer = distributed
        parallel_dims = validate(cfg, 256)
        s = rank_sizes(cfg, parallel_dims, LLAMA3_VOCAB)
        assert s.parameters == shard
        assert f"{s.optimizer_bytes / 2**30:.2f}" == f"{gib:.2f}"
        assert f"optimizer state  {gib:.2f} GiB" in report(cfg, parallel_dims)


def paper_tp_row_per_layer(s, b, h, a, t, recompute) -> float:
    """Korthikanti et al. 2022 Table 2 (bytes per layer, tensor parallel, no sequence parallel)."""
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":
        return s * b * h * (10 + 24 / t)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("tp", [1, 2])
def test_activation_bytes_follow_the_paper(recompute, tp):
    rc = "null" if recompute is None else recompute
    cfg = make_cfg("model=gpt125m", "precision=bf16", f"model.recompute_granularity={rc}",
                   f"parallelism.tensor_model_parallel_size={tp}", "data.micro_batch_size=2")
    parallel_dims = validate(cfg, 2)
    s, b, h, a, L, v = 256, 2, 768, 12, 12, 320
    golden = (L * paper_tp_row_per_layer(s, b, h, a, tp, recompute)
              + 8 * s * b + s * b * h             # embedding input and its dropout (pp 1)
              + 4 * s * b * h + 4 * s * b * v / tp)  # output layer input and the logits
    assert activation_bytes(cfg, parallel_dims, v, scores=True) == math.ceil(golden)
    cfg.precision.params_dtype = "fp32"  # fp32 activations: twice Megatron's 16-bit figure
    assert activation_bytes(cfg, parallel_dims, v, scores=True) == math.ceil(2 * golden)
    # One MTP layer: one more layer, its embedding's dropout (s b h), eh_proj's [embedding;
    # hidden] input (4 s b h), enorm's and hnorm's inputs (4 s b h), the final norm's and the
    # output layer's inputs (4 s b h), and a second logits and loss.
    cfg.precision.params_dtype = "bf16"
    cfg.model.mtp_num_layers = 1
    mtp = (paper_tp_row_per_layer(s, b, h, a, tp, recompute) + (1 + 4 + 4 + 4) * s * b * h
           + 4 * s * b * v / tp)
    assert activation_bytes(cfg, parallel_dims, v, scores=True) == math.ceil(golden + mtp)


def test_bytes_are_printed_in_the_unit_that_fits(capsys):
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 * 2**20 + 2**19, 3 * 2**40)] == [
        "0 B", "1023 B", "1.00 KiB", "5.50 MiB", "3.00 TiB"]
    cfg = make_cfg("train.dry_run=true")
    out = report(cfg, validate(cfg, 2))
    assert "0.00 GiB" not in out and "KiB (fp32)" in out, out


def test_fit_line_says_what_would_fit():
    cfg = make_cfg("experiment=llama3_70b_tp8_gtp2_bf16", "train.dry_run=true",
                   "optim.use_distributed_optimizer=false")
    parallel_dims = validate(cfg, 256)
    s = rank_sizes(cfg, parallel_dims, LLAMA3_VOCAB)
    line = fit_line(cfg, parallel_dims, LLAMA3_VOCAB, s)
    assert f"{format_bytes(s.total_bytes)} per rank does not fit train.gpu_memory_gib=80" in line
    assert "fits with optim.use_distributed_optimizer=true" in line, line
    cfg.train.gpu_memory_gib = 10_000
    assert "fits train.gpu_memory_gib=10000" in fit_line(cfg, parallel_dims, LLAMA3_VOCAB, s)
    tiny = make_cfg("train.dry_run=true")
    assert "per rank fits train.gpu_memory_gib=80" in report(tiny, validate(tiny, 2))


def paper_sp_row_per_layer(s, b, h, a, t, recompute) -> float:
    """Korthikanti et al. 2022 Table 2 (bytes per layer, tensor and sequence parallel); full
    recompute keeps each layer's input, which sequence parallelism splits over the t ranks."""
    if recompute == "full":
        return 2 * s * b * h / t
    if recompute == "selective":
        return s * b * h * 34 / t
    return s * b * h * (34 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_activation_bytes_with_sequence_parallelism_follow_the_paper(recompute):
    rc = "null" if recompute is None else recompute
    tp = 2
    cfg = make_cfg("model=gpt125m", "precision=bf16", f"model.recompute_granularity={rc}",
                   f"parallelism.tensor_model_parallel_size={tp}", "data.micro_batch_size=2",
                   "parallelism.sequence_parallel=true")
    parallel_dims = validate(cfg, 2)
    assert parallel_dims.sequence_parallel
    s, b, h, a, L, v = 256, 2, 768, 12, 12, 320
    golden = (L * paper_sp_row_per_layer(s, b, h, a, tp, recompute)
              + (8 * s * b + s * b * h) / tp          # embedding input and dropout, split
              + 4 * s * b * h / tp + 4 * s * b * v / tp)  # output layer input, logits
    assert activation_bytes(cfg, parallel_dims, v, scores=True) == math.ceil(golden)
    assert "sequence parallel)" in report(cfg, parallel_dims)


def test_expert_optimizer_state_is_sharded_over_expert_data_parallel():
    """Mixtral-8x7B as shipped (pp4 x ep8 x expert GTP 2 on 128 ranks) with the distributed
    optimizer: megatron shards the dense state over dp 32 and the routed experts' over expert dp
    2 (128 / (ep8 x pp4 x expert GTP 2)). A rank of a stage holds 8 layers x 1 expert x 3 x 4096
    x 14336 / 2 expert parameters (fc1 [gate|up], fc2; expert GTP halves each, no padding)."""
    cfg = make_cfg("experiment=mixtral_8x7b_ep8_pp4_bf16", "train.dry_run=true",
                   "optim.use_distributed_optimizer=true")
    parallel_dims = validate(cfg, 128)
    assert (parallel_dims.data_parallel_size, parallel_dims.expert_data_parallel_size) == (32, 2)
    s = rank_sizes(cfg, parallel_dims, 32000)
    experts = 8 * 1 * 3 * 4096 * 14336 // 2
    assert s.expert_parameters == experts
    dense = s.parameters - experts
    assert s.optimizer_bytes == math.ceil(12 * dense / 32) + math.ceil(12 * experts / 2)
    assert f"{s.optimizer_bytes / 2**30:.2f}" == "4.10"
    assert "routed experts 1/2: expert data parallel" in report(cfg, parallel_dims)


def paper_per_layer(s, b, h, a, f, t, sp, fused, recompute) -> float:
    """Korthikanti et al. 2022 per-layer bytes, ``s b h (34 + 5 a s / h)`` without parallelism,
    with Megatron-LM's ``34 = 18 + 4 f / h`` (f = ffn_hidden_size): tensor parallelism splits
    the ``24 = 8 + 4 f / h`` and the score term by t, sequence parallelism the ``10`` too; fused
    (flash) attention and selective recompute store no ``5 a s / h`` scores."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    stored = s * b * h * ((10 / t if sp else 10) + (8 + 4 * f / h) / t)
    if not fused and recompute is None:
        stored += s * b * h * 5 * a * s / (h * t)
    return stored


FLAGSHIP = {  # experiment: (world, L, h, a, f, t, sp, recompute), as the recipe ships
    "llama3_8b_tp4_gtp2_fp8": (8, 32, 4096, 32, 14336, 4, False, None),
    "llama3_70b_tp8_gtp2_bf16": (256, 80, 8192, 64, 28672, 8, True, None),
}


@pytest.mark.parametrize("experiment", sorted(FLAGSHIP))
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_flagship_activations_follow_the_paper_for_the_target_attention(experiment, impl,
                                                                        monkeypatch):
    """The recipe's ``model.transformer_impl``, not whether TransformerEngine imports here,
    decides whether the scores are stored; the figure is the paper's formula at seq 8192."""
    from recipes.model import te

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: False)
    world, L, h, a, f, t, sp, recompute = FLAGSHIP[experiment]
    cfg = make_cfg(f"experiment={experiment}", "train.dry_run=true")
    assert cfg.model.transformer_impl == "transformer_engine"
    cfg.model.transformer_impl = impl
    parallel_dims = validate(cfg, world)
    assert (parallel_dims.tensor_model_parallel_size, parallel_dims.sequence_parallel) == (t, sp)
    assert cfg.model.get("recompute_granularity") == recompute
    s, b, v = 8192, 1, LLAMA3_VOCAB
    split = t if sp else 1
    golden = (L * paper_per_layer(s, b, h, a, f, t, sp, impl == "transformer_engine", recompute)
              + (8 * s * b + s * b * h) / split          # embedding input and its dropout
              + 4 * s * b * h / split + 4 * s * b * v / t)  # output layer input, the logits
    assert activation_bytes(cfg, parallel_dims, v) == math.ceil(golden)
    out = report(cfg, parallel_dims)
    kind = "fused (no scores stored)" if impl == "transformer_engine" else "local (scores stored)"
    assert f"attention {kind}, from model.transformer_impl={impl}" in out, out
    assert f"{format_bytes(math.ceil(golden))} (micro-batch 1 x 8192 tokens" in out, out


RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf/experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", RECIPES)
def test_every_named_recipe_fits_its_own_target(experiment, monkeypatch, capsys, tmp_path):
    """As shipped, as ``python train.py experiment=NAME train.dry_run=true`` checks it (no
    WORLD_SIZE: the world is the recipe's parallelism.nproc_per_node; the layout from
    ``recipes.config.prelaunch.check``), on a machine without TransformerEngine: each recipe's
    dry run fits train.gpu_memory_gib, says what it assumed and what a save and a load cost,
    and writes nothing (through the launcher's ``run``, as train.py runs it)."""
    from recipes.config import prelaunch
    from recipes.model import te
    from recipes.run.launch import run

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = make_cfg(f"experiment={experiment}", "train.dry_run=true", f"output_dir={tmp_path}")
    prelaunch.check_choices({"experiment": experiment})
    run(cfg)
    out = capsys.readouterr().out
    assert "> dry run: config valid" in out, out
    assert "> per rank" in out and "optimizer state" in out, out  # pp: "(most loaded stage):"
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    assert "does not fit" not in out and "fits train.gpu_memory_gib=" in out, out
    assert "> assumed: attention " in out and "recompute " in out and "optimizer" in out, out
    assert f"checked against train.gpu_memory_gib={cfg.train.gpu_memory_gib:g}" in out, out
    assert "> checkpoint at a save and a load" in out, out
    if cfg.model.get("num_moe_experts") and cfg.parallelism.nproc_per_node > 4:
        # the GPU MoE recipes shard their experts' weights with expert GTP
        assert cfg.gtp.expert_gtp_remat_size > 1, experiment


def test_an_unknown_transformer_impl_is_refused_before_launch():
    from recipes.config import prelaunch
    from recipes.config.validate import ConfigError

    cfg = make_cfg("experiment=llama3_8b_tp4_gtp2_fp8", "train.dry_run=true",
                   "model.transformer_impl=bogus")
    with pytest.raises(ConfigError, match="model.transformer_impl='bogus': valid are null"):
        prelaunch.check_transformer_impl(cfg)
