"""A hybrid stack's MoE layers (``E``) before launch: the hybrid family takes the MoE family's
fields (``ModelFamily.takes_fields_of``), ``E`` and ``num_moe_experts`` go together, the MoE
family's rules and the expert layout rules apply, what the hybrid path cannot run is refused in
one line; the parameter table counted by hand (``model=hybrid_moe_tiny``: hidden 48, RMSNorm,
no biases, vocab 257 padded to 320, untied, pattern ``ME*E``, 4 SwiGLU experts of width 40,
top-2, a shared expert of width 32)."""

from __future__ import annotations

import pytest
from compose import make_cfg
from omegaconf import OmegaConf

from ckpt.families import ExportError, for_export
from recipes.config.parallel_dims import ParallelDims
from recipes.config.shape_fields import changed_shape_fields
from recipes.config.validate import ConfigError, validate
from recipes.families import FAMILIES, family_of, parameter_counts
from recipes.model.moe import moe_decoder_layers

# Mamba layer (hybrid_tiny's, tests/test_hybrid_config.py): norm, conv1d weight and bias,
# dt_bias, A_log, D, in_proj, gated norm, out_proj.
MAMBA = 48 + 128 * 4 + 128 + 3 * 6 + 230 * 48 + 96 + 48 * 96
ATTENTION = 48 + (4 + 2 * 4) * 12 * 48 + 48 * 48  # norm, QKV, proj
EXPERT = 2 * 40 * 48 + 48 * 40  # gated fc1 [gate | up], fc2
# MoE layer: pre_mlp_layernorm, router [4, 48], 4 experts, shared expert (gated fc1, fc2).
MOE = 48 + 4 * 48 + 4 * EXPERT + (2 * 32 * 48 + 48 * 32)
EMBEDDING = 320 * 48


def test_hybrid_moe_tiny_is_counted_by_hand_with_its_active_parameters():
    m = make_cfg("model=hybrid_moe_tiny").model
    assert family_of(m).name == "hybrid"
    total = 2 * EMBEDDING + MAMBA + 2 * MOE + ATTENTION + 48  # + final norm
    assert total == 112_258
    # A token goes through top-2 of the 4 experts of each MoE layer.
    assert parameter_counts(m, 320) == (total, total - 2 * 4 * EXPERT + 2 * 2 * EXPERT)
    # The load-balancing loss averages over these (recipes.model.moe.reduce_aux_loss): the
    # pattern's E layers, as moe_layer_freq's layers for the moe family.
    assert moe_decoder_layers(m) == 2
    assert moe_decoder_layers(make_cfg("model=moe_tiny", "model.moe_layer_freq=2").model) == 1


def test_megatron_gets_the_moe_fields_and_the_moe_layer_spec():
    cfg = make_cfg("model=hybrid_moe_tiny", "parallelism.nproc_per_node=2",
                   "parallelism.expert_model_parallel_size=2")
    dims = validate(cfg, 2)
    fields = family_of(cfg.model).transformer_config_fields(cfg.model, dims)
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_ffn_hidden_size"],
            fields["moe_shared_expert_intermediate_size"], fields["expert_model_parallel_size"],
            fields["moe_router_enable_expert_bias"], fields["mamba_head_dim"]) == (
        4, 2, 40, 32, 2, True, 16)
    dense = make_cfg("model=hybrid_gdn_tiny")
    assert "num_moe_experts" not in family_of(dense.model).transformer_config_fields(
        dense.model, ParallelDims.from_config(dense, 2))


def test_the_stack_spec_has_a_moe_layer_only_with_e_in_the_pattern():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    from recipes.families.hybrid.model import local_stack_spec

    spec = local_stack_spec(make_cfg("model=hybrid_moe_tiny").model).submodules.moe_layer
    moe = spec.submodules.mlp  # megatron's MlpBuilder: MoELayer with SequentialMLP experts
    assert spec.module is MoETransformerLayer and moe.func is MoELayer
    assert moe.keywords["submodules"].experts.func is SequentialMLP
    assert local_stack_spec(make_cfg("model=hybrid_gdn_tiny").model).submodules.moe_layer \
        is IdentityOp


@pytest.mark.parametrize("overrides,match", [
    # E without experts, experts without E: the hybrid family takes the MoE family's fields.
    (["model=hybrid_tiny", "model.hybrid_layer_pattern=ME*E", "model.num_layers=4"],
     r"model.hybrid_layer_pattern='ME\*E' has MoE layers \('E'\): set model.num_moe_experts"),
    (["model=hybrid_tiny", "model.num_moe_experts=4"],
     r"model.num_moe_experts=4 with no MoE layer \('E'\) in model.hybrid_layer_pattern="
     r"'M\*-M\*-': add 'E' layers or set model.num_moe_experts=null"),
    # What the hybrid path cannot run.
    (["model.moe_layer_freq=2"], r"model.moe_layer_freq=2: the pattern's 'E' symbols place"),
    # megatron's MoELayer trains at TP > 1 only with sequence parallelism (recipes.model.moe).
    (["parallelism=tp2"], r"an MoE model at parallelism.tensor_model_parallel_size=2 needs "
                          r"sequence parallelism .*: set parallelism.sequence_parallel=true"),
    (["checkpoint.format=stock"], r"checkpoint.format=stock with MoE layers"),
    # The MoE family's rules and the expert layout rules (recipes.model.moe).
    (["model.moe_router_score_function=softmax"],
     r"model.moe_router_enable_expert_bias=true with model.moe_router_score_function='softmax'"),
    (["model.moe_shared_expert_intermediate_size=0"],
     r"model.moe_shared_expert_intermediate_size=0 must be >= 1"),
    (["parallelism.nproc_per_node=3", "parallelism.expert_model_parallel_size=3"],
     r"model.num_moe_experts=4 is not divisible by parallelism.expert_model_parallel_size=3"),
    (["model.add_bias_linear=true"], r"model.add_bias_linear=true with an MoE model"),
    (["model.moe_ffn_hidden_size=41", "parallelism.nproc_per_node=2",
      "parallelism.expert_tensor_parallel_size=2"],
     r"model.moe_ffn_hidden_size=41 must be divisible by "
     r"parallelism.expert_tensor_parallel_size=2"),
])
def test_what_the_hybrid_moe_path_cannot_run_is_refused_before_launch(overrides, match):
    cfg = make_cfg("model=hybrid_moe_tiny", *overrides)
    with pytest.raises(ConfigError, match=match) as info:
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["parallelism=tp2"],
    ["parallelism=tp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
     "gtp.expert_gtp_remat_size=2", "parallelism.expert_model_parallel_size=2",
     "parallelism.expert_tensor_parallel_size=1", "optim.use_distributed_optimizer=true"],
    ["parallelism=tp2pp2", "parallelism.expert_tensor_parallel_size=1",
     "parallelism.expert_model_parallel_size=2"],
])
def test_moe_layers_run_at_tp2_with_sequence_parallelism(overrides):
    """MoE layers at TP > 1 with sequence parallelism, alone and with GTP, EP, expert TP, pipeline
    stages and the distributed optimizer (trained: tests/test_moe_layouts.py)."""
    cfg = make_cfg("model=hybrid_moe_tiny", *overrides, "parallelism.sequence_parallel=true")
    assert validate(cfg, cfg.parallelism.nproc_per_node).sequence_parallel


def test_the_moe_family_still_refuses_a_hybrid_pattern():
    """Taking is one way: the hybrid family takes the MoE family's fields, not the reverse."""
    cfg = make_cfg("model=moe_tiny", "model.hybrid_layer_pattern=E*")
    with pytest.raises(ConfigError, match=r"model.hybrid_layer_pattern='E\*' is a field of the "
                                          r"'hybrid' family, not of model.family='moe'"):
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert [f.name for f in FAMILIES if f.takes_fields_of] == ["hybrid"]


def test_a_resume_that_changes_the_experts_names_the_field():
    saved = OmegaConf.to_container(make_cfg("model=hybrid_moe_tiny").model, resolve=True)
    now = make_cfg("model=hybrid_moe_tiny", "model.moe_ffn_hidden_size=32",
                   "model.num_moe_experts=8").model
    assert changed_shape_fields(saved, OmegaConf.to_container(now, resolve=True)) == [
        "num_moe_experts", "moe_ffn_hidden_size"]


def test_a_hybrid_moe_model_is_not_exported():
    with pytest.raises(ExportError, match=r"hybrid_layer_pattern='ME\*E'.*layer symbols"):
        for_export(dict(make_cfg("model=hybrid_moe_tiny").model))
