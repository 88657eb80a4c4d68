"""Multi-token prediction before launch: megatron's config fields, the refusals, the parameter
table and the dry run's figures (the figures here are worked out by hand from llama_tiny's dims:
hidden 72, 6 heads of 12 in 2 query groups, SwiGLU ffn 200, RMSNorm, no biases, vocab 257
padded to 320, untied)."""

from __future__ import annotations

import pytest
from compose import make_cfg

from recipes.dry_run.sizes import rank_sizes
from recipes.families import family_of, parameter_counts
from recipes.model.gtp_setup import weight_reuse
from recipes.config.parallel_dims import ParallelDims
from recipes.config.validate import ConfigError, validate

# One decoder layer: norms 2 x 72, QKV (6 + 2 * 2) * 12 = 120 rows x 72, proj 72 x 72, SwiGLU
# fc1 400 x 72, fc2 72 x 200.
LAYER = 2 * 72 + 120 * 72 + 72 * 72 + 400 * 72 + 72 * 200
# An MTP layer: enorm, hnorm, final norm, eh_proj 72 x 144, and a decoder layer.
MTP_LAYER = 3 * 72 + 72 * 144 + LAYER
EMBEDDING = 320 * 72


def test_megatron_gets_the_mtp_fields_only_with_mtp_layers():
    plain = make_cfg("model=llama_tiny")
    mtp = make_cfg("model=llama_tiny", "model.mtp_num_layers=2",
                   "model.mtp_loss_scaling_factor=0.3")
    dims = ParallelDims.from_config(plain, 1)
    fields = family_of(plain.model).transformer_config_fields(plain.model, dims)
    assert "mtp_num_layers" not in fields
    fields = family_of(mtp.model).transformer_config_fields(mtp.model, dims)
    assert (fields["mtp_num_layers"], fields["mtp_loss_scaling_factor"]) == (2, 0.3)


@pytest.mark.parametrize("model", ["llama_tiny", "moe_tiny"])
def test_an_mtp_layer_adds_its_parameters_to_the_count(model):
    plain = make_cfg(f"model={model}").model
    mtp = make_cfg(f"model={model}", "model.mtp_num_layers=1").model
    total, active = parameter_counts(plain, 320)
    total_mtp, active_mtp = parameter_counts(mtp, 320)
    if model == "llama_tiny":
        assert total == active == 2 * LAYER + 72 + 2 * EMBEDDING
        assert total_mtp == active_mtp == total + MTP_LAYER
    else:  # the MTP layer is MoE like the last decoder layer: as much as one layer adds
        assert total_mtp - total == 3 * 72 + 72 * 144 + (total - 72 - 2 * EMBEDDING) // 2
        assert active_mtp - active == 3 * 72 + 72 * 144 + (active - 72 - 2 * EMBEDDING) // 2


def test_the_dry_run_puts_the_mtp_layer_and_an_embedding_copy_on_the_last_stage():
    cfg = make_cfg("model=llama_tiny", "model.mtp_num_layers=1", "parallelism=pp2",
                   "train.dry_run=true")
    s = rank_sizes(cfg, validate(cfg, 2), 257)
    # Last stage: layer 1, the final norm, the MTP layer, the output layer, the embedding copy.
    assert s.parameters == LAYER + 72 + MTP_LAYER + 2 * EMBEDDING == 171_072


@pytest.mark.parametrize("overrides, message", [
    (["model.mtp_num_layers=-1"], r"model.mtp_num_layers=-1 must be >= 0"),
    (["model.mtp_loss_scaling_factor=-0.1"], r"model.mtp_loss_scaling_factor=-0.1 must be >= 0"),
    (["parallelism=pp2", "model=tiny"],
     r"model.mtp_num_layers=1 at pipeline_model_parallel_size=2 needs "
     r"model.position_embedding_type=rope"),
    (["parallelism=pp2", "model.share_embeddings_and_output_weights=true"],
     r"model.mtp_num_layers=1 at pipeline_model_parallel_size=2 needs "
     r"model.share_embeddings_and_output_weights=false"),
    (["parallelism.context_parallel_size=2"],
     r"model.mtp_num_layers=1 with parallelism.context_parallel_size=2"),
])
def test_what_megatron_does_not_keep_in_step_is_refused_before_launch(overrides, message):
    cfg = make_cfg("model=llama_tiny", "model.mtp_num_layers=1", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2)


def test_pp1_runs_learned_positions_and_tied_embeddings_with_mtp():
    validate(make_cfg("model=tiny", "model.mtp_num_layers=1",
                      "model.share_embeddings_and_output_weights=true"), 2)


def test_mtp_and_tied_embeddings_each_use_a_gtp_weight_twice():
    assert weight_reuse(make_cfg("model=llama_tiny").model) is None
    assert weight_reuse(make_cfg("model=llama_tiny", "model.mtp_num_layers=1").model) == \
        "model.mtp_num_layers=1"
    assert weight_reuse(make_cfg("model=llama_tiny",
                                 "model.share_embeddings_and_output_weights=true").model) == \
        "model.share_embeddings_and_output_weights=true"
