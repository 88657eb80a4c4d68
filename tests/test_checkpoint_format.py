"""``checkpoint.format`` picks how GTP weights lie on disk; its old name ``gtp.checkpoint_layout``
is an alias that keeps working: either key typed sets both, and the format applied before the
model is built (``recipes.model.gtp_setup.before_model``) is the one typed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from compose import CONF, make_cfg
from hydra import compose, initialize_config_dir

from ckpt.format import logical_format
from recipes.model import gtp_setup
from recipes.config.prelaunch import check_checkpoint_format
from recipes.config.validate import ConfigError


@pytest.mark.parametrize("overrides, want", [
    ([], "logical"),
    (["checkpoint.format=stock"], "stock"),
    (["gtp.checkpoint_layout=stock"], "stock"),            # the old name
    (["gtp=tp2_align16", "checkpoint=none", "gtp.checkpoint_layout=stock"], "stock"),
    (["checkpoint.format=stock", "gtp.checkpoint_layout=stock"], "stock"),
])
def test_either_name_sets_both(overrides, want):
    cfg = make_cfg(*overrides)
    assert (cfg.checkpoint.format, cfg.gtp.checkpoint_layout) == (want, want)
    check_checkpoint_format(cfg)


def test_the_composed_config_reads_the_same_before_resolving():
    """train.py's config is not resolved: the alias holds through the interpolations."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=["gtp.checkpoint_layout=stock"])
    assert cfg.checkpoint.format == "stock"
    assert cfg.gtp.get("checkpoint_layout", "logical") == "stock"


@pytest.mark.parametrize("key", ["checkpoint.format", "gtp.checkpoint_layout"])
def test_the_format_typed_under_either_name_is_the_one_applied(key):
    was = logical_format.is_installed()
    no_gtp = SimpleNamespace(uses_gtp=False)
    try:
        gtp_setup.before_model(make_cfg(f"{key}=stock"), no_gtp)
        assert not logical_format.is_installed()
        gtp_setup.before_model(make_cfg(f"{key}=logical"), no_gtp)
        assert logical_format.is_installed()
    finally:
        logical_format.configure("logical" if was else "stock")


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.format=padded"], r"checkpoint.format='padded' .*valid are \('logical', 'stock'\)"),
    (["gtp.checkpoint_layout=padded"], r"gtp.checkpoint_layout='padded'\): valid are"),
    (["checkpoint.format=stock", "gtp.checkpoint_layout=logical"],
     r"checkpoint.format='stock' and its old name gtp.checkpoint_layout='logical' disagree"),
])
def test_a_bad_or_contradicting_format_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_checkpoint_format(make_cfg(*overrides))


def test_configure_names_the_key_and_the_valid_values():
    with pytest.raises(ValueError, match=r"checkpoint.format='padded'.*\['logical', 'stock'\]"):
        logical_format.configure("padded")
