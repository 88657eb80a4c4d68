"""The hybrid family before launch: which models it owns, megatron's Mamba fields, the
parameter table (figures worked out by hand from hybrid_tiny's dims: hidden 48, RMSNorm, no
biases, 4 heads of 12, ffn 120, Mamba d_inner 96 in 6 heads of 16, 2 groups of state 8, vocab
257 padded to 320, untied, pattern ``M*-M*-``), the refusals and the export's class."""

from __future__ import annotations

import pytest
from compose import make_cfg

from ckpt.families import ExportError, for_export
from recipes.families import family_of, parameter_counts
from recipes.config.parallel_dims import ParallelDims
from recipes.config.validate import ConfigError, validate

# Mamba layer: norm 48; conv1d (96 + 2 * 2 * 8 = 128 channels) weight 128 x 1 x 4 and bias 128;
# dt_bias, A_log, D 6 each; in_proj (2 * 96 + 2 * 16 + 6 = 230) x 48; gated norm 96; out_proj
# 48 x 96.
MAMBA = 48 + 128 * 4 + 128 + 3 * 6 + 230 * 48 + 96 + 48 * 96
ATTENTION = 48 + (4 + 2 * 4) * 12 * 48 + 48 * 48  # norm, QKV, proj
MLP = 48 + 120 * 48 + 48 * 120  # norm, fc1, fc2
EMBEDDING = 320 * 48


def test_hybrid_tiny_is_the_hybrid_family_and_its_count_is_worked_out_by_hand():
    m = make_cfg("model=hybrid_tiny").model
    assert family_of(m).name == "hybrid"
    total = 2 * EMBEDDING + 2 * (MAMBA + ATTENTION + MLP) + 48  # + final norm
    assert total == 105_332
    assert parameter_counts(m, 320) == (total, total)


def test_biases_and_a_learned_position_embedding_are_counted():
    m = make_cfg("model=hybrid_tiny", "model.add_bias_linear=true",
                 "model.position_embedding_type=learned_absolute").model
    # Per attention layer QKV 144 + proj 48 biases; per MLP layer fc1 120 + fc2 48; position
    # embedding 64 x 48; the mixer's in_proj and out_proj have no bias in megatron.
    total = 105_332 + 64 * 48 + 2 * (144 + 48) + 2 * (120 + 48)
    assert parameter_counts(m, 320) == (total, total)


def test_a_pattern_without_mamba_layers_skips_the_mamba_sizes():
    cfg = make_cfg("model=hybrid_tiny", "model.hybrid_layer_pattern=*-*-*-",
                   "model.mamba_head_dim=0")
    validate(cfg, cfg.parallelism.nproc_per_node)


def test_megatron_gets_the_mamba_fields():
    cfg = make_cfg("model=hybrid_tiny", "model.mamba_num_heads=6")
    fields = family_of(cfg.model).transformer_config_fields(cfg.model,
                                                          ParallelDims.from_config(cfg, 2))
    assert (fields["mamba_state_dim"], fields["mamba_head_dim"], fields["mamba_num_groups"],
            fields["mamba_num_heads"]) == (8, 16, 2, 6)
    assert fields["num_layers"] == 6 and fields["normalization"] == "RMSNorm"


# GatedDeltaNet layer (hybrid_gdn_tiny: 2 key heads of 12, 4 value heads of 8, kernel 4): norm
# 48; dt_bias, A_log 4 each; in_proj (2 * 24 + 2 * 32 + 2 * 4 = 120) x 48; conv1d (24 + 24 + 32
# = 80 channels) 80 x 1 x 4; out_norm 8 (one value head); out_proj 48 x 32.
GDN = 48 + 2 * 4 + 120 * 48 + 80 * 4 + 8 + 48 * 32
SWIGLU_MLP = 48 + 2 * 120 * 48 + 48 * 120


def test_hybrid_gdn_tiny_is_counted_by_hand_and_megatron_gets_the_gdn_fields():
    cfg = make_cfg("model=hybrid_gdn_tiny")
    m = cfg.model
    total = 2 * EMBEDDING + 2 * MAMBA + 2 * GDN + ATTENTION + SWIGLU_MLP + 48  # "MG*-MG"
    assert total == 105_620
    assert parameter_counts(m, 320) == (total, total)
    fields = family_of(m).transformer_config_fields(m, ParallelDims.from_config(cfg, 2))
    assert {k: fields[k] for k in fields if k.startswith("linear_")} == {
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 12, "linear_num_key_heads": 2,
        "linear_value_head_dim": 8, "linear_num_value_heads": 4}
    validate(cfg, cfg.parallelism.nproc_per_node)


@pytest.mark.parametrize("overrides,match", [
    (["model.swiglu=false"], r"model.swiglu=false: GatedDeltaNet layers \('G'\) apply the "
                             r"model's activation .* set model.swiglu=true"),
    (["model.linear_num_value_heads=3"], r"model.linear_num_value_heads=3 must be a multiple "
                                         r"of model.linear_num_key_heads=2"),
    (["parallelism=tp2dp2", "model.linear_num_key_heads=1"],
     r"model.linear_num_key_heads=1 must be divisible by tensor_model_parallel_size=2"),
    (["model.linear_key_head_dim=0"], r"model.linear_key_head_dim=0 is invalid"),
    (["model.linear_conv_kernel_dim=-1"], r"model.linear_conv_kernel_dim=-1 is invalid"),
    (["parallelism=tp2dp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
      "checkpoint.format=stock"], "asserts on GatedDeltaNet's GTP in_proj"),
])
def test_what_gated_delta_net_layers_cannot_run_is_refused_naming_the_field(overrides, match):
    cfg = make_cfg("model=hybrid_gdn_tiny", *overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, cfg.parallelism.nproc_per_node)


def test_a_gated_delta_net_model_is_not_exported():
    with pytest.raises(ExportError, match="hybrid_layer_pattern='MG\\*-MG'.*layer symbols .* "
                                          "no GatedDeltaNet layer"):
        for_export(dict(make_cfg("model=hybrid_gdn_tiny").model))


# hybrid_tiny with one MTP depth of attention and MLP layers (megatron's unified pattern).
_MTP_PATTERN = "model.hybrid_layer_pattern='M*-M*-/*-'"


def test_an_mtp_part_is_counted_by_hand_and_megatron_gets_its_depths():
    """One MTP depth ``*-``: enorm, hnorm, eh_proj (48 x 96), an attention and an MLP layer and
    the final norm, after the decoder's 6 layers (num_layers counts the part before '/')."""
    cfg = make_cfg("model=hybrid_tiny", _MTP_PATTERN, "model.mtp_num_layers=1")
    validate(cfg, cfg.parallelism.nproc_per_node)
    mtp = 48 + 48 + 48 * 96 + ATTENTION + MLP + 48
    assert parameter_counts(cfg.model, 320) == (105_332 + mtp,) * 2
    fields = family_of(cfg.model).transformer_config_fields(cfg.model,
                                                          ParallelDims.from_config(cfg, 2))
    assert (fields["num_layers"], fields["mtp_num_layers"]) == (6, 1)


def test_a_hybrid_mtp_model_is_not_exported():
    cfg = make_cfg("model=hybrid_tiny", _MTP_PATTERN, "model.mtp_num_layers=1")
    with pytest.raises(ExportError, match=r"model.mtp_num_layers=1 .*multi-token prediction "
                                          r"layers are not exported"):
        for_export(dict(cfg.model))


@pytest.mark.parametrize("overrides,match", [
    (["model.hybrid_layer_pattern=MS*-M-"], "'S': DeepSeek sparse attention"),
    (["model.hybrid_layer_pattern=MX*-M-"], "'X': not a layer symbol"),
    (["model.hybrid_layer_pattern=M*-|M*-"], "'|' stage boundaries are not supported"),
    (["model.num_layers=5"], "has 6 decoder layers but model.num_layers=5"),
    (["parallelism=tp2dp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
      "checkpoint.format=stock"], "checkpoint.format=stock under GTP"),
    (["parallelism=tp2dp2", "model.mamba_num_groups=3", "model.mamba_num_heads=6"],
     r"model.mamba_num_groups = 3 must be divisible by tensor_model_parallel_size=2"),
    (["model.mamba_num_groups=4"], r"Mamba heads = 6 must be divisible by "
                                   r"model.mamba_num_groups=4"),
    (["model.mamba_head_dim=40"], r"model.mamba_head_dim=40 must divide 2 \* model.hidden_size"),
    # The example is built of layers this model has (no 'E' here), one part a depth asked for.
    (["model.mtp_num_layers=1"], r"0 MTP depths but model.mtp_num_layers=1: give one '/'.*"
                                 r"'M\*-M\*-/\*-' model.mtp_num_layers=1"),
    (["model.mtp_num_layers=2"], r"'M\*-M\*-/\*-/\*-' model.mtp_num_layers=2"),
    (["model.mtp_num_layers=-1"], r"model.mtp_num_layers=-1 must be >= 0"),
    ([_MTP_PATTERN], "1 MTP depth but model.mtp_num_layers=null"),
    ([_MTP_PATTERN, "model.mtp_num_layers=2"], "1 MTP depth but model.mtp_num_layers=2"),
    (["model.hybrid_layer_pattern='M*-M*-/*-/-*'", "model.mtp_num_layers=2"],
     "MTP parts differ"),
    (["model.hybrid_layer_pattern='M*-M*-/'", "model.mtp_num_layers=1"], "an empty MTP part"),
    (["model.hybrid_layer_pattern='M*-M*-/*|-'", "model.mtp_num_layers=1"],
     r"'\|' in the MTP part"),
    (["model.hybrid_layer_pattern='/*-'", "model.mtp_num_layers=1"],
     "no decoder layer before '/'"),
    (["model.hybrid_layer_pattern='M*-M*-/*X'", "model.mtp_num_layers=1"],
     "'X': not a layer symbol"),
    (["model.hybrid_layer_pattern='M*-M*-M/*-'", "model.mtp_num_layers=1"],
     r"has 7 decoder layers but model.num_layers=6: .* \(the MTP part after '/' not counted\)"),
    ([_MTP_PATTERN, "model.mtp_num_layers=1", "checkpoint.format=stock"],
     "checkpoint.format=stock with MTP layers: not tested in a hybrid stack"),
    ([_MTP_PATTERN, "model.mtp_num_layers=1", "parallelism=pp2",
      "model.position_embedding_type=learned_absolute"],
     "model.mtp_num_layers=1 at pipeline_model_parallel_size=2 needs "
     "model.position_embedding_type=rope"),
    (["model.transformer_impl=transformer_engine"], "builds megatron's local layers"),
    (["model.hybrid_layer_pattern=''"], r"model.hybrid_layer_pattern='' is empty: .* or "
                                        r"model.family=gpt model.hybrid_layer_pattern=null"),
    (["model.mamba_head_dim=0"], r"model.mamba_head_dim=0 is invalid: it must be an integer"),
    (["model.mamba_num_groups=0"], r"model.mamba_num_groups=0 is invalid"),
    (["model.mamba_num_heads=0"], r"model.mamba_num_heads=0 is invalid"),
    (["model.mamba_state_dim=-8"], r"model.mamba_state_dim=-8 is invalid"),
    (["model.mamba_chunk_size=0"], r"model.mamba_chunk_size=0 is invalid"),
    (["parallelism=pp2", "parallelism.virtual_pipeline_model_parallel_size=3"],
     "virtual_pipeline_model_parallel_size=3: megatron-core 0.19.2 places"),
])
def test_what_the_family_does_not_run_is_refused_before_launch(overrides, match):
    cfg = make_cfg("model=hybrid_tiny", *overrides)
    world = cfg.parallelism.nproc_per_node
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)


@pytest.mark.parametrize("model", ["hybrid_tiny", "hybrid_gdn_tiny"])
def test_sequence_parallelism_is_accepted(model):
    """Mamba and GatedDeltaNet layers at tp2 with sequence parallelism, with GTP: their in_proj
    gathers the sequence, their out_proj reduce-scatters it (megatron's linears)."""
    cfg = make_cfg(f"model={model}", "parallelism=tp2dp2", "parallelism.sequence_parallel=true",
                   "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16")
    assert validate(cfg, cfg.parallelism.nproc_per_node).sequence_parallel


def test_bf16_is_accepted():
    """bf16 weights with fp32 main params train and resume (tests/test_hybrid_e2e.py,
    tests/test_hybrid_layouts.py): megatron's Float16Module casts the mixer's A_log and D too."""
    cfg = make_cfg("model=hybrid_tiny", "precision=bf16")
    validate(cfg, cfg.parallelism.nproc_per_node)


def test_a_hybrid_model_exports_to_nemotron_h_and_what_it_cannot_compute_is_refused():
    m = dict(make_cfg("model=hybrid_tiny").model)
    assert for_export(m).hf_class == "NemotronHForCausalLM"
    for field, value, why in (("normalization", "LayerNorm", "norms are RMSNorm"),
                              ("position_embedding_type", "rope", "no position embedding"),
                              ("add_bias_linear", True, "writes no linear biases"),
                              ("swiglu", True, "MLP is not gated"),
                              ("qk_layernorm", True, "no q/k norms"),
                              ("layernorm_epsilon", 1e-6, "eps 1e-5")):
        with pytest.raises(ExportError, match=f"model.{field}={value!r}: NemotronHForCausalLM "
                                              f"does not compute .*{why}"):
            for_export({**m, field: value})
    # The same dims as a GPT model (no pattern): the GPT family's answer.
    m.update(family="gpt", hybrid_layer_pattern=None)
    with pytest.raises(ExportError, match="no transformers class computes this model exactly"):
        for_export(m)


def _nemotron_h(pattern: str, use_cache: bool):
    """A tiny random NemotronH of ``pattern`` (transformers' own classes, no export code),
    drawn from a fixed seed: the same model whatever ran before."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)

    types = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    config = NemotronHConfig(
        vocab_size=64, hidden_size=32, layers_block_type=[types[s] for s in pattern],
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=40,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16,
        use_cache=use_cache)
    return NemotronHForCausalLM(config).eval()


PATTERNS = ("M*-M*-", "*M", "M-*", "**", "*-M", "MMMM", "M-M-", "M", "-M*", "--", "-*M")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_exports_use_cache_is_off_exactly_where_transformers_cache_fails(pattern):
    """transformers 5.25's NemotronH cache fails for some patterns (model(ids) raises): the
    export writes use_cache false for exactly those, and without the cache every pattern runs
    forward and generate()."""
    import torch

    from recipes.families.hybrid.formats import cache_works, notes

    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        try:
            _nemotron_h(pattern, use_cache=True)(ids)
            ran = True
        except (ValueError, AttributeError):
            ran = False
        assert cache_works(pattern) == ran
        assert notes({"hybrid_layer_pattern": pattern}).get("use_cache", True) == ran
        model = _nemotron_h(pattern, use_cache=False)
        assert model(ids).logits.shape == (1, 7, 64)
        # min_new_tokens: a random model may draw its end-of-sequence id and stop early.
        assert model.generate(ids, max_new_tokens=2, min_new_tokens=2,
                              do_sample=False).shape == (1, 9)


def _logical_tensors(m, vocab: int = 320) -> dict:
    """Random full tensors named as a checkpoint stores a pattern without Mamba layers (the
    parameter names: no packed weight to split)."""
    import torch

    from recipes.families.hybrid.params import parameter_shapes

    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in parameter_shapes(m, vocab)}


def test_a_pattern_without_mamba_layers_counts_and_exports_with_mamba_sizes_unset():
    """No Mamba layer: the dry run's table and the export never read the Mamba sizes (here 0),
    and the model's own layernorm_epsilon is NemotronH's (only the mixer fixes it at 1e-5)."""
    from transformers import NemotronHForCausalLM

    from ckpt.hf.hf_export import build_state

    cfg = make_cfg("model=hybrid_tiny", "model.hybrid_layer_pattern=*-*-*-",
                   "model.mamba_head_dim=0", "model.layernorm_epsilon=1e-6")
    attention_mlp = ATTENTION + MLP
    assert parameter_counts(cfg.model, 320)[0] == 2 * EMBEDDING + 3 * attention_mlp + 48
    m = dict(cfg.model)
    arch = for_export(m)
    config, state = build_state(arch, _logical_tensors(cfg.model), m, 257, {}, "ckpt")
    assert config.layer_norm_epsilon == 1e-6 and config.use_cache
    NemotronHForCausalLM(config).load_state_dict(state, strict=True)


def test_a_tensor_the_recorded_config_does_not_describe_is_refused_by_name():
    """A checkpoint of six layers whose recorded pattern has four: the export would silently
    drop layers 4 and 5; it refuses, naming them."""
    from ckpt.hf.hf_export import build_state

    saved = make_cfg("model=hybrid_tiny", "model.hybrid_layer_pattern=*-*-*-").model
    m = {**dict(saved), "hybrid_layer_pattern": "*-*-", "num_layers": 4}
    with pytest.raises(ExportError, match=r"ckpt holds 6 model tensors that the recorded run "
                                          r"config's NemotronHForCausalLM has no place for: "
                                          r"\['decoder.layers.4.input_layernorm.weight'"):
        build_state(for_export(m), _logical_tensors(saved), m, 257, {}, "ckpt")


def test_a_stages_prefix_build_takes_the_first_layers_in_its_own_segment():
    """recipes.model.build replays the layers before a pipeline stage with the pattern's first
    symbols in the stage's own ``|`` segment (megatron's select_pipeline_segment picks segment
    ``stage``), MTP left out; tests/test_moe_layouts.py's hybrid pp2 case shows the weights."""
    from recipes.families.hybrid.model import prefix_pattern

    assert prefix_pattern("GEGE*E", 3, 1, 2) == "|GEG"
    assert prefix_pattern("M*M*M*M*/*E", 4, 2, 4) == "||M*M*|"


def test_the_dry_run_counts_an_mtp_part_by_its_own_layers():
    """bf16, pp 1, no attention scores: the MTP depth ``-`` adds its MLP sublayer (5 + 4 x 120
    / 48 = 15 per s b h; a whole transformer layer would be 28), and the MTP head's 13 s b h +
    its logits 4 s b v; its parameters on the model line."""
    from recipes.dry_run import activation_bytes, report

    base = make_cfg("model=hybrid_tiny", "precision=bf16", "data.micro_batch_size=2")
    mtp = make_cfg("model=hybrid_tiny", "precision=bf16", "data.micro_batch_size=2",
                   "model.hybrid_layer_pattern='M*-M*-/-'", "model.mtp_num_layers=1")
    s, b, h, v = 64, 2, 48, 320
    got = [activation_bytes(cfg, validate(cfg, 2), v, scores=False) for cfg in (base, mtp)]
    assert got[1] - got[0] == s * b * h * 15 + 13 * s * b * h + 4 * s * b * v
    mtp.train.dry_run = True
    out = report(mtp, validate(mtp, 2))
    assert "1 MTP layer included" in out and f"{105_332 + 4_752 + MLP:,}" in out, out
