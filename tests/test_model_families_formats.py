"""The model families' formats as ``ckpt/`` finds them: given to it by ``recipes.families``
(``ckpt/families.py``'s ``install``), each family's Hugging Face mappings and stock-format names in
its own folder (``recipes/families/<name>/formats.py``), none in ``gtp/`` or ``ckpt/``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Names of megatron's GPTModel parameters and of Hugging Face tensors that a family maps. HF's
# "lm_head" is not among them: every transformers *ForCausalLM names its output head so, and
# gtp/ handles a tied one generically.
FAMILY_NAMES = re.compile(
    r"\b(linear_qkv|linear_proj|linear_fc1|linear_fc2|word_embeddings|output_layer|"
    r"final_layernorm|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_attn|c_fc|"
    r"embed_tokens|wte|wpe)\b")
# The gtp/ and ckpt/ modules that still name megatron parameters, each for a reason of its own, not a
# family's mapping.
ALLOWED = {
    # Muon's q/k/v split of megatron's fused linear_qkv (the same layout in every family).
    "gtp/muon.py",
    # The gated fc1 of megatron's MLP module, recorded for the logical format.
    "ckpt/format/sharding_record.py",
    # The output_layer gradient group of the per-layer grad stats.
    "gtp/grad_stats.py",
    # A tensor name in a docstring's example of a verify failure.
    "ckpt/verify.py",
    # The keys of megatron's vocab-row tensors, whose padded rows a checkpoint adapts.
    "ckpt/adapt/vocab.py",
    # The stock reader's dims, read off megatron's unsharded tensors (qkv / fc1 biases, the
    # final norm) and the layout key qkv_rows described by linear_qkv.
    "ckpt/stock/specs.py",
}


def test_the_registry_lists_the_gpt_hybrid_llava_and_moe_families():
    from ckpt.families import FamilyFormats, families

    assert [f.name for f in families()] == ["gpt", "hybrid", "llava", "moe"]
    assert all(isinstance(f, FamilyFormats) for f in families())


def test_install_refuses_what_is_not_a_familys_formats_and_replaces_what_was_given():
    from ckpt import families as registry
    from recipes.families import FORMATS, family_name
    from recipes.families.formats import padded_vocab_of_config

    with pytest.raises(TypeError, match="'gpt' is a str, not a ckpt.families.FamilyFormats"):
        registry.install(["gpt"])
    try:
        registry.install(())
        with pytest.raises(RuntimeError, match="no model families were given to ckpt/"):
            registry.importable()
        registry.install(FORMATS[:1])
        assert [f.name for f in registry.families()] == ["gpt"]
        assert registry.run_config_vocab() is None
    finally:
        registry.install(FORMATS, run_config_vocab=padded_vocab_of_config,
                         family_name=family_name)
    assert [f.name for f in registry.families()] == ["gpt", "hybrid", "llava", "moe"]


def test_each_importable_model_type_is_one_familys():
    from ckpt.families import families, for_model_type, importable

    owners: dict[str, list[str]] = {}
    for f in families():
        for a in f.architectures:
            if a.imports is not None:
                owners.setdefault(a.model_type, []).append(f.name)
    assert owners == {"gpt2": ["gpt"], "llama": ["gpt"], "mistral": ["gpt"], "qwen2": ["gpt"],
                      "qwen3": ["gpt"], "mixtral": ["moe"], "qwen3_moe": ["moe"],
                      "deepseek_v3": ["moe"], "glm4_moe": ["moe"], "qwen3_next": ["hybrid"]}
    assert importable() == sorted(owners)
    for model_type in owners:
        assert for_model_type(model_type).model_type == model_type


@pytest.mark.parametrize("model_type", ["phi3", "qwen2_moe"])  # qwen2_moe: shared experts
def test_a_refused_model_type_names_the_registrys_importable_types(model_type):
    from ckpt.families import for_model_type, importable
    from ckpt.hf.hf_weights import HFImportError

    with pytest.raises(HFImportError) as err:
        for_model_type(model_type)
    assert str(err.value) == (f"config.json model_type={model_type!r}: importable are "
                              f"{importable()}")


def test_each_model_is_exported_by_its_family():
    from ckpt.families import for_export

    llama = {"normalization": "RMSNorm", "add_bias_linear": False,
             "position_embedding_type": "rope", "swiglu": True, "num_attention_heads": 4}
    assert for_export({"num_attention_heads": 4}).hf_class == "GPT2LMHeadModel"
    assert for_export(llama).hf_class == "LlamaForCausalLM"
    assert for_export({**llama, "add_qkv_bias": True}).hf_class == "Qwen2ForCausalLM"
    assert for_export({**llama, "qk_layernorm": True}).hf_class == "Qwen3ForCausalLM"
    assert for_export({**llama, "num_moe_experts": 4}).hf_class == "MixtralForCausalLM"


def test_the_stock_reader_classifies_keys_by_the_families_patterns():
    from ckpt.families import gtp_patterns
    from ckpt.stock.specs import gtp_kind, is_plain
    from recipes.families.gpt.formats import GTP_PATTERNS
    from recipes.families.hybrid import formats as hybrid

    assert gtp_patterns() == GTP_PATTERNS + hybrid.GTP_PATTERNS  # families by name: gpt, hybrid
    assert gtp_kind("decoder.layers.mlp.experts.experts.linear_fc1.weight") == "fc1"
    assert gtp_kind("decoder.layers.self_attention.linear_qkv.bias") is None
    assert gtp_kind("decoder.layers.3.mixer.out_proj.weight") == "proj"
    for key in ("decoder.layers.3.mixer.in_proj.weight.dt", "decoder.layers.0.mixer.A_log",
                "decoder.layers.0.mixer.conv1d.weight.B", "decoder.layers.0.mixer.norm.weight"):
        assert is_plain(key) and gtp_kind(key) is None, key
    # An in_proj stored whole is not known: a GTP checkpoint holding one is refused, naming it.
    assert not is_plain("decoder.layers.0.mixer.in_proj.weight")
    # GatedDeltaNet (megatron's stock format, without GTP: its keys are the logical ones).
    net = "decoder.layers.1.self_attention."
    assert gtp_kind(net + "out_proj.weight") == "proj"
    for key in (net + "in_proj.weight.query", net + "in_proj.weight.alpha", net + "A_log",
                net + "dt_bias", net + "conv1d.weight.value", net + "out_norm.weight",
                "decoder.layers.1.input_layernorm.weight"):
        assert is_plain(key) and gtp_kind(key) is None, key
    assert not is_plain(net + "in_proj.weight") and not is_plain(net + "conv1d.weight")


def test_a_mamba_only_model_file_tells_the_stock_reader_its_hidden_size():
    """Without a layout record the reader needs hidden_size for out_proj's logical rows; in a
    model of Mamba layers only no attention or MLP weight gives it, the final norm does."""
    from ckpt.stock.specs import infer_dims

    layer = "decoder.layers.0.mixer."
    shapes = {"embedding.word_embeddings.weight": (320, 48), layer + "out_proj.weight": (64, 96),
              layer + "in_proj.weight.x": (96, 48), layer + "A_log": (6,),
              "decoder.layers.0.norm.weight": (48,), "decoder.final_norm.weight": (48,)}
    assert infer_dims(shapes) == {"hidden_size": 48}


def test_gtp_names_no_familys_tensors_outside_the_allowed_modules():
    mentioning = {str(p.relative_to(ROOT)) for package in ("gtp", "ckpt")
                  for p in sorted((ROOT / package).rglob("*.py"))
                  if FAMILY_NAMES.search(p.read_text())}
    assert mentioning == ALLOWED
