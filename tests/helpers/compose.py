"""Compose ``conf/`` with Hydra's compose API, as ``train.py`` does, for tests without processes."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipes.config.schema import register_configs

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


def make_cfg(*overrides: str):
    """The composed config with the Hydra-only interpolations (output dir, cache) filled in."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=["output_dir=/tmp/unused", "checkpoint.save=null",
                                           "data.cache_dir=/tmp/unused", *overrides])
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
