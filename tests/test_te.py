"""The TransformerEngine switch (recipes/model/te.py): config -> TransformerConfig fields and layer spec,
with TransformerEngine absent (as in CI) and present (a stand-in module)."""

from __future__ import annotations

import sys

import pytest
from compose import make_cfg

from recipes.model import te
from recipes.families.gpt import model as gpt_model
from recipes.model.build import transformer_config
from recipes.config.validate import validate


def test_usable_with_the_stand_in(stand_in_te):
    assert te.transformer_engine_usable()


def test_absent_without_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    assert not te.transformer_engine_usable()


@pytest.mark.parametrize("gtp, want", [
    ("off", {}),
    ("tp2_fp8", {"fp8": "hybrid", "fp8_recipe": "tensorwise"}),
    ("tp2_mxfp8", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}),
    ("tp2_nvfp4", {"fp4": "e2m1", "fp4_recipe": "nvfp4"}),
])
def test_recipe_sets_megatron_quantization_fields_only_with_te(gtp, want):
    cfg = make_cfg("model=llama_tiny", f"gtp={gtp}")
    parallel_dims = validate(cfg, 2)
    with_te = transformer_config(cfg, parallel_dims, use_te=True)
    without = transformer_config(cfg, parallel_dims, use_te=False)
    assert with_te.transformer_impl == "transformer_engine"
    assert without.transformer_impl == "local"
    for field in ("fp8", "fp8_recipe", "fp4"):
        if field in want:
            assert getattr(with_te, field) == want[field], field
        else:
            assert not getattr(with_te, field) or field == "fp8_recipe", field
    assert without.fp8 is None and without.fp4 is None
    # The Llama options reach megatron's fields either way.
    for c in (with_te, without):
        assert (c.normalization, c.num_query_groups, c.add_bias_linear, c.gated_linear_unit) == (
            "RMSNorm", 2, False, True)


def test_fp8_param_gather_keeps_weights_in_fp8_only_with_te():
    """gtp.fp8_param_gather: megatron's TransformerConfig.fp8_param and the DDP config's
    fp8_param_gather with TransformerEngine; nothing without it (local layers, no FP8)."""
    cfg = make_cfg("model=llama_tiny", "gtp=tp2_fp8", "gtp.fp8_param_gather=true",
                   "optim.use_distributed_optimizer=true")
    parallel_dims = validate(cfg, 2)
    with_te = transformer_config(cfg, parallel_dims, use_te=True)
    without = transformer_config(cfg, parallel_dims, use_te=False)
    assert with_te.fp8_param is True and with_te.fp8 == "hybrid"
    assert te.ddp_fields(with_te) == {"fp8_param_gather": True}
    assert without.fp8_param is False and te.ddp_fields(without) == {"fp8_param_gather": False}
    plain = make_cfg("model=llama_tiny", "gtp=tp2_fp8")
    assert transformer_config(plain, validate(plain, 2), use_te=True).fp8_param is False


@pytest.mark.parametrize("overrides, message", [
    (["gtp=tp2_align16"], r"needs an FP8 recipe: gtp.quantization='none'; valid are \['fp8', 'mxfp8'\]"),
    (["gtp=tp2_nvfp4", "optim.use_distributed_optimizer=true"],
     r"gtp.quantization='nvfp4'; valid are"),
    (["gtp=tp2_mxfp8"], r"needs optim.use_distributed_optimizer=true"),
])
def test_fp8_param_gather_is_refused_before_launch(overrides, message):
    from recipes.config.validate import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides, "gtp.fp8_param_gather=true"), 2)


def test_layer_spec_choice():
    m = make_cfg("model=llama_tiny").model
    assert gpt_model.spec_builder(m, True) == ("get_gpt_layer_with_transformer_engine_spec", {})
    assert gpt_model.spec_builder(m, False) == ("get_gpt_layer_local_spec",
                                                {"normalization": "RMSNorm"})


def test_build_uses_the_te_spec_when_te_is_importable(stand_in_te, monkeypatch):
    """The GPT family's layer_spec calls megatron's TE spec function (recorded here: the stand-in has
    no TE layers to build)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs

    calls = []
    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: calls.append(kw) or "te-spec")
    m = make_cfg("model=llama_tiny").model
    spec = gpt_model.layer_spec(m, None, te.transformer_engine_usable())
    assert spec == "te-spec" and calls == [{}]


def test_notice_without_te(capsys, monkeypatch):
    monkeypatch.setattr(te, "transformer_engine_usable", lambda: False)
    validate(make_cfg("gtp=tp2_fp8"), 2)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "without TransformerEngine" in out and "nothing is quantized" in out


def test_notice_with_te(capsys, monkeypatch):
    monkeypatch.setattr(te, "transformer_engine_usable", lambda: True)
    validate(make_cfg("gtp=tp2_fp8"), 2)
    out = capsys.readouterr().out
    assert "TransformerEngine layers with transformer_impl=transformer_engine, fp8=hybrid, " \
           "fp8_recipe=tensorwise" in out, out


@pytest.mark.parametrize("impl, usable, expected", [
    (None, True, True), ("transformer_engine", True, True), ("local", True, False),
    (None, False, False), ("transformer_engine", False, False), ("local", False, False)])
def test_model_transformer_impl_local_builds_local_layers_even_with_te(impl, usable, expected,
                                                                         monkeypatch):
    """The dry run's attention (recipes.dry_run.target_attention) and the built layers agree
    wherever TransformerEngine imports; without it every run builds local layers."""
    from compose import make_cfg

    from recipes.model import te

    monkeypatch.setattr(te, "transformer_engine_usable", lambda: usable)
    cfg = make_cfg()
    cfg.model.transformer_impl = impl
    assert te.uses_transformer_engine(cfg) is expected
