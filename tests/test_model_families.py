"""A model family is one folder under ``recipes/families/``, registered once, chosen by name.

Every preset names the family written down here (``model.family``); a name that is no family's,
or fields of another family, are refused in one line; a model config saved before
``model.family`` existed still gets the family its fields imply. Everything a family gives the
run is defined in its own folder (the MoE family may reuse the GPT family it extends), its own
fields included, which no other family names; every family folder is registered; megatron's
linear-layer names appear in ``recipes/`` only inside family folders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from compose import make_cfg

from recipes.config.errors import ConfigError
from recipes.families import FAMILIES, family_of
from recipes.families.family import ModelFamily

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
MOE_PRESETS = {"moe_tiny", "mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v3", "deepseek_v3_tiny"}
HYBRID_PRESETS = {"hybrid_tiny", "hybrid_gdn_tiny", "hybrid_moe_tiny", "qwen3_next_tiny",
                  "qwen3_next_80b_a3b"}
LLAVA_PRESETS = {"llava_tiny"}
# What a family may take from another family's folder: the one it builds on, and those whose
# fields it takes (ModelFamily.takes_fields_of: the hybrid family's MoE layers).
# The families whose fields another may name: the MoE family builds GPT's model; the hybrid
# family builds GPT's attention and MLP layers (gpt.model.transformer_config_fields, its MLA and
# rope fields refused or exported by name) and takes the MoE family's fields.
BUILDS_ON = {"moe": {"gpt"}, "hybrid": {"gpt"}}
for _f in FAMILIES:
    BUILDS_ON[_f.name] = BUILDS_ON.get(_f.name, set()) | set(_f.takes_fields_of)


def _family(preset: str) -> str:
    return ("moe" if preset in MOE_PRESETS else "hybrid" if preset in HYBRID_PRESETS
            else "llava" if preset in LLAVA_PRESETS else "gpt")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_names_its_family(preset):
    text = (ROOT / "conf" / "model" / f"{preset}.yaml").read_text()
    assert f"\nfamily: {_family(preset)}\n" in text
    assert family_of(make_cfg(f"model={preset}").model).name == _family(preset)


@pytest.mark.parametrize("overrides,message", [
    (["model=tiny", "model.num_moe_experts=4"],
     "model.num_moe_experts=4 is a field of the 'moe' family, not of model.family='gpt': set "
     "model.family=moe or model.num_moe_experts=null"),
    (["model=moe_tiny", "model.num_moe_experts=null"],
     "model.family='moe' needs model.num_moe_experts (it is None): set it, or choose another "
     "family (valid are ['gpt', 'moe', 'hybrid', 'llava'])"),
    (["model=tiny", "model.family=hybrid"],
     "model.family='hybrid' needs model.hybrid_layer_pattern (it is None): set it, or choose "
     "another family (valid are ['gpt', 'moe', 'hybrid', 'llava'])"),
    (["model=hybrid_tiny", "model.vision_model_type=clip"],
     "model.vision_model_type='clip' is a field of the 'llava' family, not of "
     "model.family='hybrid': set model.family=llava or model.vision_model_type=null"),
])
def test_a_family_named_but_contradicted_is_refused_in_one_line(overrides, message):
    from recipes.config.validate import validate

    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert str(info.value) == message


def test_an_unknown_family_name_is_refused_naming_the_valid_ones():
    from recipes.config.validate import validate

    cfg = make_cfg("model=tiny", "model.family=mamba")
    with pytest.raises(ConfigError) as info:
        validate(cfg, cfg.parallelism.nproc_per_node)
    assert str(info.value) == ("model.family='mamba' is not a model family: valid are "
                               "['gpt', 'moe', 'hybrid', 'llava']")


@pytest.mark.parametrize("preset", PRESETS)
def test_a_model_config_saved_without_a_family_gets_the_one_its_fields_imply(preset):
    """A checkpoint's saved run config, resolved config or export written before
    ``model.family`` existed holds the same fields without ``family``: it resumes (no shape
    field differs from the preset's) and exports as the preset does."""
    from ckpt.families import ExportError, for_export
    from recipes.config.shape_fields import changed_shape_fields
    from recipes.config.schema import to_dict

    now = to_dict(make_cfg(f"model={preset}").model)
    saved = {k: v for k, v in now.items() if k != "family"}
    assert family_of(saved).name == _family(preset)
    assert changed_shape_fields(saved, now) == []
    try:
        expected = for_export(now).hf_class
    except ExportError as exc:
        expected = str(exc)
    try:
        assert for_export(saved).hf_class == expected
    except ExportError as exc:
        assert str(exc) == expected


def test_a_resume_into_another_family_names_the_family_first():
    from recipes.config.shape_fields import changed_shape_fields
    from recipes.config.schema import to_dict

    saved = {k: v for k, v in to_dict(make_cfg("model=llama_tiny").model).items()
             if k != "family"}  # a checkpoint written before model.family
    now = to_dict(make_cfg("model=moe_tiny").model)
    assert changed_shape_fields(saved, now)[:2] == ["family", "num_moe_experts"]


def test_each_familys_own_fields_are_in_the_model_schema_once():
    from dataclasses import fields

    from recipes.config.schema import ModelConfig, SharedModelFields

    shared = [f.name for f in fields(SharedModelFields)]
    own = [f.name for family in FAMILIES for f in fields(family.fields)]
    assert len(set(shared + own)) == len(shared + own)
    assert [f.name for f in fields(ModelConfig)] == shared + own
    for family in FAMILIES:
        names = {f.name for f in fields(family.fields)}
        # Its shape fields may include those of the family it builds on (the MoE family: the
        # GPT family's multi-latent attention).
        built_on = {f.name for other in FAMILIES if other.name in BUILDS_ON.get(family.name, ())
                    for f in fields(other.fields)}
        assert set(family.requires) <= names, family.name
        assert set(family.shape_fields) <= names | built_on, family.name


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_no_family_folder_names_another_familys_fields(family):
    """A family's rules, formats and export name its own and the shared fields only (and
    those of the family it builds on, whose model it builds): which family a model is comes
    from ``model.family``, not from another family's fields."""
    from dataclasses import fields

    others = {f.name for other in FAMILIES
              if other is not family and other.name not in BUILDS_ON.get(family.name, ())
              for f in fields(other.fields)}
    pattern = re.compile(r"\b(" + "|".join(sorted(others)) + r")\b")
    found = [f"{p.name}: {m.group(0)}"
             for p in sorted((ROOT / "recipes" / "families" / family.name).glob("*.py"))
             for m in pattern.finditer(p.read_text())]
    assert found == []


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_everything_a_family_gives_is_defined_in_its_folder(family):
    allowed = {family.name} | BUILDS_ON.get(family.name, set())
    for field in ModelFamily.__dataclass_fields__:
        value = getattr(family, field)
        if not callable(value) or value is ModelFamily.building:
            continue
        if value.__module__ == "contextlib":  # the default: nothing while building
            continue
        parts = value.__module__.split(".")
        assert parts[:2] == ["recipes", "families"] and parts[2] in allowed, (field, value.__module__)


def test_every_family_folder_is_registered_once():
    folders = sorted(p.parent.name for p in (ROOT / "recipes" / "families").glob("*/__init__.py"))
    names = [f.name for f in FAMILIES]
    assert sorted(names) == folders and len(set(names)) == len(names)


# Files outside the family folders that name megatron's linear layers, and why.
LINEAR_NAMES_ALLOWED = {
    "recipes/model/shapes.py": "ParamShape's docstring example and qkv_rows, the attention width math",
    "recipes/config/validate.py": "a docstring example of the short name of a GTP weight",
}


def test_megatron_linear_names_live_in_family_folders():
    pattern = re.compile(r"linear_(qkv|proj|fc1|fc2)")
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "recipes").rglob("*.py")
             if "families" not in p.parts and pattern.search(p.read_text())}
    assert found == set(LINEAR_NAMES_ALLOWED)


def test_the_moe_family_extends_the_gpt_family_config_fields():
    """The MoE family's TransformerConfig fields are the GPT family's plus the MoE ones."""
    from recipes.families.gpt.model import transformer_config_fields as dense
    from recipes.families.moe.model import transformer_config_fields as moe
    from recipes.config.validate import validate

    cfg = make_cfg("model=moe_tiny")
    dims = validate(cfg, 2)
    base, extended = dense(cfg.model, dims), moe(cfg.model, dims)
    assert {k: extended[k] for k in base} == base
    assert extended["num_moe_experts"] == 4 and extended["expert_model_parallel_size"] == 1


# Dense tiny presets (moe_tiny's built experts are checked by tests/test_moe_layouts.py) and
# hybrid_moe_tiny, at tp1 (its MoE layers refuse TP; its expert layouts: test_hybrid_moe_layouts).
TINY_PRESETS = [p for p in PRESETS if p.endswith("tiny") and p not in MOE_PRESETS]
TP1_PRESETS = {"hybrid_moe_tiny", "qwen3_next_tiny"}


def _build_each(cfg_yamls: dict) -> dict:
    """On every rank of the world: ``{preset: differences between the built model's
    parameters on this rank and the family's table}`` (recipes.model.shapes.local_shape)."""
    from layout_goldens import build

    from recipes.families import parameter_shapes
    from recipes.model.shapes import local_shape, padded_vocab_size

    out = {}
    for name, cfg_yaml in cfg_yamls.items():
        model, _, _, record, cfg = build(cfg_yaml)
        tp = record["tensor_model_parallel_size"]
        padded = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by, tp)
        want = {p.name: local_shape(p, tp, 1, 0)[0] for p in parameter_shapes(cfg.model, padded)}
        got = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
        out[name] = [f"{n}: built {got.get(n)}, table {want.get(n)}"
                     for n in sorted(got.keys() | want.keys()) if got.get(n) != want.get(n)]
        # A LLaVA model's MLPs are its language model's (its ViT's are GeLU by megatron's spec).
        decoder = getattr(model.module, "decoder", None) or model.module.language_model.decoder
        mlp = next(layer.mlp for layer in decoder.layers if hasattr(layer, "mlp"))
        out[name].append(getattr(mlp, "config", model.module.config).activation_func.__name__)
    return out


@pytest.mark.multiprocess
def test_every_tiny_preset_builds_the_parameters_of_its_table():
    """megatron builds, at tp2, exactly the parameters the family's table lists (names and
    per-rank shapes) for every tiny preset, and the activation the preset names."""
    from layout_goldens import make_cfg as layout_cfg
    from multiproc import run_distributed

    cfgs = {p: layout_cfg(p, 1 if p in TP1_PRESETS else 2, 1, None, 2, "logical",
                          *(["data=shapes"] if p in LLAVA_PRESETS else [])) for p in TINY_PRESETS}
    # The hybrid table's optional parameters: biases, q/k norms, a learned position embedding;
    # and the gate rows of gated attention's linear_qkv.
    cfgs["hybrid_tiny+biases"] = layout_cfg(
        "hybrid_tiny", 2, 1, None, 2, "logical", "model.add_bias_linear=true",
        "model.qk_layernorm=true", "model.position_embedding_type=learned_absolute",
        "model.attention_output_gate=true")
    # The LLaVA table's learned position embedding over text and image embeddings.
    cfgs["llava_tiny+positions"] = layout_cfg(
        "llava_tiny", 2, 1, None, 2, "logical", "data=shapes",
        "model.position_embedding_type=learned_absolute", "model.drop_vision_class_token=true")
    results = run_distributed(_build_each, 2, cfgs, timeout=300)
    activation = {"gpt2_tiny": "gelu_tanh", "tiny": "gelu", "hybrid_tiny": "gelu"}
    for rank, res in enumerate(results):
        for preset, problems in res.items():
            *problems, act = problems
            assert not problems, (rank, preset, problems[:5])
            assert act == activation.get(preset.split("+")[0], "silu"), (preset, act)


def test_a_resume_of_a_run_saved_without_a_family_takes_the_family_its_fields_imply():
    """``checkpoint.load=DIR`` alone (the default preset, model=tiny) takes the checkpoint's
    model fields; from a run saved before ``model.family`` (here an MoE model's), the family
    its fields imply comes with them, so the composed config is that family's and passes."""
    from types import SimpleNamespace

    from recipes.checkpoint.policy import take_checkpoint_fields
    from recipes.config.schema import to_dict
    from recipes.config.validate import validate

    saved = {k: v for k, v in to_dict(make_cfg("model=moe_tiny").model).items() if k != "family"}
    plan = SimpleNamespace(path="ckpt", common={"train_state": {"config": {"model": saved}}})
    cfg = make_cfg()
    note = take_checkpoint_fields(cfg, plan, overrides=[])
    assert cfg.model.family == "moe" and "model.family=moe" in note
    validate(cfg, cfg.parallelism.nproc_per_node)
