"""What the pre-launch tests share (tests/test_prelaunch.py, tests/test_prelaunch_launcher.py):
a tripwire that fails a test whose worker would start, ``recipes.run.launch.run`` on the
config ``train.py`` would compose, and a folder of small text inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from compose import CONF
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture
def launch_tripwire(monkeypatch):
    """Fail the test if a worker would start."""
    import recipes.run.launch
    import recipes.run.worker

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(recipes.run.launch, "launch_local", started)
    monkeypatch.setattr(recipes.run.worker, "run", started)
    for key in ("RANK", "WORLD_SIZE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")


def run_in_process(out: Path, *overrides: str):
    """``recipes.run.launch.run`` on the config ``train.py`` would compose from ``overrides``."""
    from recipes.run.launch import run

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"output_dir={out}", f"checkpoint.save={out}/checkpoints",
            f"data.cache_dir={out}/cache", "logger=none", "train.train_iters=4", *overrides],
            return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        run(cfg)
    return cfg


def write_text_files(d: Path) -> Path:
    """Small inputs under ``d``: two text files, a JSONL, an empty folder, an empty .bin/.idx
    pair and a folder whose config.json is not a Hugging Face one; returns ``d``."""
    (d / "one.txt").write_text(TEXT)
    (d / "two.txt").write_text(TEXT)
    (d / "lines.jsonl").write_text('{"text": "a b c"}\n' * 3)
    (d / "empty").mkdir()
    (d / "x.bin").write_bytes(b"")
    (d / "x.idx").write_bytes(b"")
    (d / "nothf").mkdir()  # a config.json that is not a Hugging Face one
    (d / "nothf" / "config.json").write_text('{"foo": 1}')
    return d
