"""MoE models and layouts without processes: the presets' parameter counts against Hugging Face
``transformers`` models built on the meta device, the dry run's MoE lines, and every MoE layout
rule refused before launch with the value and a fix named."""

from __future__ import annotations

import pytest
import torch
from compose import make_cfg

from recipes.families import parameter_counts, parameter_shapes
from recipes.config.validate import ConfigError, validate


def _hf_counts(config) -> tuple[int, int]:
    """(total, active) of a transformers MoE model built on the meta device: active keeps, of
    each layer's routed experts (names with ``.experts.``), top-k / num_experts."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    k, e = config.num_experts_per_tok, getattr(config, "num_local_experts", None) or config.num_experts
    return total, total - experts + experts * k // e


def _mixtral():
    from transformers import MixtralConfig

    # Mixtral-8x7B-v0.1's published config.json
    return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3MoeConfig

    # Qwen3-30B-A3B's published config.json
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False)


@pytest.mark.parametrize("preset, hf_config, vocab, published", [
    ("mixtral_8x7b", _mixtral, 32000, (46_702_792_704, 12_879_925_248)),
    ("qwen3_30b_a3b", _qwen3, 151936, (30_532_122_624, 3_353_032_704)),
])
def test_moe_presets_count_what_transformers_builds(preset, hf_config, vocab, published):
    cfg = make_cfg(f"model={preset}")
    # Both vocabularies are multiples of 128 (make_vocab_size_divisible_by): no padding rows.
    ours = parameter_counts(cfg.model, vocab)
    assert ours == _hf_counts(hf_config())
    assert ours == published


def test_moe_tiny_shapes():
    m = make_cfg("model=moe_tiny").model
    shapes = {p.name: p for p in parameter_shapes(m, 320)}
    fc1 = shapes["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (200, 72) and fc1.expert and fc1.gtp  # SwiGLU: [gate | up] of 100 rows
    assert shapes["decoder.layers.0.mlp.router.weight"].shape == (4, 72)
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in shapes
    assert 200 % 32 and 72 % 32  # GTP alignment (16 x 2) pads both
    total, active = parameter_counts(m, 320)
    experts = sum(p.shape[0] * p.shape[1] for p in shapes.values() if p.expert)
    assert (total, active) == (250_920, 250_920 - experts // 2)


def test_dry_run_prints_active_parameters_and_expert_bytes(capsys):
    from recipes.run.launch import run

    run(make_cfg("model=moe_tiny", "checkpoint=none", "parallelism.expert_model_parallel_size=2",
                 "train.dry_run=true"))
    out = capsys.readouterr().out
    # 2 layers x 2 local experts x (200 x 72 + 72 x 100) = 86,400 on each EP rank
    assert "250,920 parameters" in out, out
    assert ("> MoE: 164,520 active parameters per token (top-2 of 4 experts); per rank 86,400 "
            "routed-expert parameters, 337.50 KiB (fp32)") in out, out
    assert "experts ep2 x etp1 x edp1" in out, out


def test_mixtral_recipe_layout_dry_run(capsys):
    from recipes.run.launch import run

    run(make_cfg("model=mixtral_8x7b", "checkpoint=none", "data=indexed",
                 "data.vocab_size=32000", "data.eod_id=2", "parallelism=tp4", "parallelism.sequence_parallel=true",
                 "parallelism.expert_model_parallel_size=8",
                 "parallelism.expert_tensor_parallel_size=1", "train.dry_run=true"))
    out = capsys.readouterr().out
    assert "46,702,792,704 parameters" in out and "12,879,925,248 active" in out, out
    # 8 experts / ep8 = 1 expert per rank: 32 layers x 3 x 14336 x 4096
    assert "per rank 5,637,144,576 routed-expert parameters" in out, out


@pytest.mark.parametrize("overrides, world, message", [
    (["parallelism.expert_model_parallel_size=3"], 3,
     "model.num_moe_experts=4 is not divisible by parallelism.expert_model_parallel_size=3"),
    (["parallelism.expert_model_parallel_size=4"], 2,
     "world size 2 is not divisible by the expert grid expert_tensor_parallel_size=1 x "
     "expert_model_parallel_size=4"),
    (["parallelism=tp2"], 2, "set parallelism.sequence_parallel=true"),
    (["parallelism.expert_tensor_parallel_size=2", "model.add_bias_linear=true"], 2,
     "model.add_bias_linear=true with an MoE model"),
    (["model.add_bias_linear=true"], 1, "so the first backward fails; set "
     "model.add_bias_linear=false"),
    (["model.moe_token_dispatcher_type=flex"], 2, "'flex' needs DeepEP or HybridEP"),
    (["model.moe_router_topk=5"], 2, "model.moe_router_topk=5 must lie in [1"),
    (["gtp.expert_gtp_remat_size=16", "gtp.pad_for_alignment=0"], 16,
     "needs every GTP dim 0 divisible by gtp_remat_size=16; not divisible: [72, 200]"),
    (["parallelism.context_parallel_size=2"], 2, "TEDotProductAttention"),
    (["model.num_moe_experts=0"], 2, "model.num_moe_experts=0 must be >= 1 (or null: dense)"),
    (["model.moe_router_topk=1"], 2,
     "model.moe_router_topk=1 needs model.moe_router_pre_softmax=true"),
    (["model.moe_aux_loss_coeff=-1"], 2, "model.moe_aux_loss_coeff=-1.0 must be >= 0"),
    (["model.moe_shared_expert_gate=true"], 2,
     "model.moe_shared_expert_gate=true without a shared expert: set "
     "model.moe_shared_expert_intermediate_size"),
    # DeepSeek-V3 routing (recipes/families/moe/checks.py)
    (["model.moe_router_score_function=sqrtsoftplus"], 2,
     "model.moe_router_score_function='sqrtsoftplus': valid are ('softmax', 'sigmoid')"),
    (["model.moe_router_enable_expert_bias=true"], 2,
     "model.moe_router_enable_expert_bias=true with model.moe_router_score_function='softmax': "
     "megatron's aux-loss-free expert bias needs sigmoid scores"),
    (["model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=-0.001"], 2,
     "model.moe_router_bias_update_rate=-0.001 must be >= 0"),
    (["model.moe_router_score_function=sigmoid", "model.moe_router_pre_softmax=true"], 2,
     "model.moe_router_pre_softmax=true with model.moe_router_score_function='sigmoid': "
     "megatron ignores it"),
    (["model.moe_router_topk_scaling_factor=0"], 2,
     "model.moe_router_topk_scaling_factor=0.0 must be > 0"),
    (["model.moe_router_num_groups=2"], 2, "model.moe_router_num_groups=2 without "
     "model.moe_router_group_topk: group-limited routing needs both"),
    (["model.moe_router_group_topk=1"], 2, "model.moe_router_group_topk=1 without "
     "model.moe_router_num_groups"),
    (["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"], 2,
     "model.moe_router_num_groups=3 must divide model.num_moe_experts=4 into equal groups; "
     "valid: [1, 2, 4]"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=3"], 2,
     "model.moe_router_group_topk=3 must lie in [1, 2]"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=1"], 2,
     "model.moe_router_group_topk=1 groups of 1 experts hold fewer than "
     "model.moe_router_topk=2: raise model.moe_router_group_topk to at least 2"),
    (["model.moe_shared_expert_intermediate_size=0"], 2,
     "model.moe_shared_expert_intermediate_size=0 must be >= 1"),
    (["model.moe_layer_freq=0"], 2, "model.moe_layer_freq=0 must be >= 1"),
    (["model.moe_layer_freq=[0,1,1]"], 2,
     "model.moe_layer_freq has 3 entries but model.num_layers=2"),
    (["model.moe_layer_freq=[0,2]"], 2, "model.moe_layer_freq=[0, 2]: an int >= 1"),
    (["model.moe_layer_freq=[0,0]"], 2, "model.moe_layer_freq=[0, 0] has no MoE layer"),
    (["model.moe_layer_freq=every"], 2, "model.moe_layer_freq='every': an int >= 1"),
])
def test_bad_moe_layouts_are_refused(overrides, world, message):
    cfg = make_cfg("model=moe_tiny", *overrides)
    with pytest.raises(ConfigError, match=None) as info:
        validate(cfg, world)
    assert message in str(info.value), str(info.value)


def test_expert_sizes_need_an_moe_model():
    with pytest.raises(ConfigError) as info:
        validate(make_cfg("parallelism.expert_model_parallel_size=2"), 2)
    assert "needs routed experts" in str(info.value) and "model=moe_tiny" in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (("optim.use_distributed_optimizer=true",), "set optim.use_distributed_optimizer=false"),
    (("precision=bf16",), "use precision=fp32"),
])
def test_stock_moe_checkpoints_with_bf16_or_the_distributed_optimizer_are_refused(overrides,
                                                                                  message):
    # docs/moe.md, Checkpoints: stock MoE checkpoints are tested with fp32 and the plain optimizer.
    with pytest.raises(ConfigError) as info:
        validate(make_cfg("model=moe_tiny", "checkpoint.save=/tmp/somewhere",
                          "checkpoint.format=stock", *overrides), 2)
    assert message in str(info.value) and "checkpoint=none" in str(info.value), str(info.value)
    validate(make_cfg("model=moe_tiny", "checkpoint=none", "checkpoint.format=stock",
                      *overrides), 2)


@pytest.mark.parametrize("overrides", [("optim.use_distributed_optimizer=true",),
                                       ("precision=bf16",),
                                       ("precision=bf16", "optim.use_distributed_optimizer=true")])
def test_moe_checkpoints_with_bf16_or_the_distributed_optimizer_are_accepted(overrides):
    # tests/test_moe_checkpoint_layouts.py restores them exactly at other layouts.
    validate(make_cfg("model=moe_tiny", "checkpoint.save=/tmp/somewhere",
                      "parallelism.expert_model_parallel_size=2", *overrides), 2)
    # Expert GTP too (its expert data-parallel group shards the expert optimizer state).
    validate(make_cfg("model=moe_tiny", "checkpoint.save=/tmp/somewhere",
                      "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16", *overrides), 4)


def test_moe_checkpoints_in_the_stock_format_are_accepted():
    # ckpt.stock reads stock expert-GTP checkpoints at other layouts
    # (tests/test_moe_stock_format.py).
    parallel_dims = validate(make_cfg("model=moe_tiny", "checkpoint.save=/tmp/somewhere",
                                      "checkpoint.format=stock",
                                      "parallelism.expert_model_parallel_size=2",
                                      "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"), 4)
    assert parallel_dims.expert_gtp_remat_size == 2


def test_default_world_covers_the_expert_grid():
    cfg = make_cfg("model=moe_tiny", "parallelism=tp1", "parallelism.expert_model_parallel_size=2")
    assert cfg.parallelism.nproc_per_node == 2
    cfg = make_cfg("model=moe_tiny", "parallelism=tp1", "gtp.expert_gtp_remat_size=2",
                   "parallelism.expert_tensor_parallel_size=2")
    assert cfg.parallelism.nproc_per_node == 4
    parallel_dims = validate(make_cfg("model=moe_tiny", "checkpoint=none", "parallelism=tp2",
                                      "parallelism.sequence_parallel=true"), 2)
    assert parallel_dims.describe() == "tp2+sp x dp1 (world 2)"


def test_sequence_parallel_is_off_at_tp1():
    parallel_dims = validate(make_cfg("parallelism.sequence_parallel=true"), 2)
    assert parallel_dims.sequence_parallel is False


def test_top1_routing_with_pre_softmax_reaches_megatron():
    """Top-1 is valid with the softmax over all experts first (megatron's TopKRouter refuses it
    otherwise); the field reaches the TransformerConfig arguments."""
    from recipes.families.moe.model import transformer_config_fields

    cfg = make_cfg("model=moe_tiny", "model.moe_router_topk=1", "model.moe_router_pre_softmax=true")
    fields = transformer_config_fields(cfg.model, validate(cfg, 2))
    assert (fields["moe_router_topk"], fields["moe_router_pre_softmax"]) == (1, True)


@pytest.mark.parametrize("field, value", [("num_moe_experts", 8), ("moe_ffn_hidden_size", 96),
                                          ("qk_layernorm", True), ("moe_layer_freq", 2)])
def test_a_resume_into_another_moe_shape_names_the_field(field, value):
    """The checkpoint's model differs from this config's in one MoE field: the refusal names
    it with the checkpoint's value (was an empty field list)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ckpt.io import CheckpointError
    from recipes.config.prelaunch import check_model_shape

    saved = OmegaConf.to_container(make_cfg("model=moe_tiny").model, resolve=True)
    cfg = make_cfg("model=moe_tiny", f"model.{field}={value}", "checkpoint.load=/tmp/unused")
    plan = SimpleNamespace(path="CKPT", common={"train_state": {"config": {"model": saved}}})
    with pytest.raises(CheckpointError) as info:
        check_model_shape(cfg, plan)
    assert f"model.{field}={value!r} (checkpoint: {saved[field]!r})" in str(info.value)
    assert f"set model.{field}=" in str(info.value)


# DeepSeek-V3-style routing on moe_tiny (tests/test_moe_checkpoint_layouts.py builds and
# checkpoints it at four expert layouts).
DEEPSEEK = ("model=moe_tiny", "model.num_moe_experts=8", "model.moe_layer_freq=[0,1]",
            "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
            "model.moe_router_bias_update_rate=0.002", "model.moe_router_num_groups=4",
            "model.moe_router_group_topk=2", "model.moe_router_topk_scaling_factor=2.5",
            "model.moe_shared_expert_intermediate_size=64")


def test_deepseek_routing_reaches_megatron():
    """The routing fields, megatron's names, reach the TransformerConfig arguments; the list
    form of moe_layer_freq as a list of ints; megatron's own checks take them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from recipes.families.moe.model import transformer_config_fields

    cfg = make_cfg(*DEEPSEEK)
    fields = transformer_config_fields(cfg.model, validate(cfg, 2))
    assert {k: fields[k] for k in (
        "moe_router_score_function", "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
        "moe_layer_freq")} == {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.002, "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
        "moe_shared_expert_intermediate_size": 64, "moe_layer_freq": [0, 1]}
    assert type(fields["moe_layer_freq"]) is list  # not OmegaConf's ListConfig
    TransformerConfig(**{k: v for k, v in fields.items() if k != "expert_gtp_weight_remat_size"})
    # The defaults: megatron's (softmax, no bias, rate 1e-3, no groups, no scaling, every layer).
    plain = transformer_config_fields(make_cfg("model=moe_tiny").model,
                                      validate(make_cfg("model=moe_tiny"), 2))
    assert (plain["moe_router_score_function"], plain["moe_router_enable_expert_bias"],
            plain["moe_router_bias_update_rate"], plain["moe_router_num_groups"],
            plain["moe_router_group_topk"], plain["moe_router_topk_scaling_factor"],
            plain["moe_layer_freq"]) == ("softmax", False, 1e-3, None, None, None, 1)


def test_dense_first_layers_in_the_table_and_the_counts():
    """moe_layer_freq as a list: layer 0 dense (ffn_hidden_size, no router), layer 1 MoE with
    the shared expert; the active count takes top-2 of 8 of the one MoE layer's experts."""
    from recipes.families.moe.params import is_moe_layer

    m = make_cfg(*DEEPSEEK).model
    assert [is_moe_layer(m, i) for i in range(2)] == [False, True]
    assert [is_moe_layer(make_cfg("model=moe_tiny", "model.moe_layer_freq=2").model, i)
            for i in range(3)] == [True, False, True]  # the int form: i % N == 0
    shapes = {p.name: p for p in parameter_shapes(m, 320)}
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"].shape == (400, 72)
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in shapes)
    assert shapes["decoder.layers.1.mlp.router.weight"].shape == (8, 72)
    assert shapes["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (128, 72)
    assert not shapes["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].expert
    total, active = parameter_counts(m, 320)
    experts = 8 * (200 * 72 + 72 * 100)
    assert active == total - experts + experts * 2 // 8


def test_a_resume_that_switches_the_expert_bias_names_the_field():
    """The expert bias is a stored tensor of each MoE layer: a checkpoint without it does not
    resume into a run with it (named before launch), and the reverse."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ckpt.io import CheckpointError
    from recipes.config.prelaunch import check_model_shape

    saved = OmegaConf.to_container(make_cfg(*DEEPSEEK).model, resolve=True)
    cfg = make_cfg(*DEEPSEEK, "model.moe_router_enable_expert_bias=false",
                   "checkpoint.load=/tmp/unused")
    plan = SimpleNamespace(path="CKPT", common={"train_state": {"config": {"model": saved}}})
    with pytest.raises(CheckpointError) as info:
        check_model_shape(cfg, plan)
    assert ("model.moe_router_enable_expert_bias=False (checkpoint: True)"
            in str(info.value)), str(info.value)
