"""Pre-launch checks of the launcher itself: a stray RANK or WORLD_SIZE, the world size from the
environment, typed group options, ``nproc_per_node``, warmup past the run, a data split that
cannot hang the dataset builder, a run too big for this machine's memory, a tokenizer.json
parsed once. As tests/test_prelaunch.py: ``recipes.run.launch.run`` in this process, the local
launcher replaced by a tripwire."""

from __future__ import annotations

import os

import pytest
from compose import CONF
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from prelaunch import TEXT, launch_tripwire, run_in_process, write_text_files  # noqa: F401 (fixture)

from recipes.config.validate import ConfigError


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_text_files(tmp_path_factory.mktemp("text"))


# A stray RANK or WORLD_SIZE in the environment (no torchrun): the value and the fix.
@pytest.mark.parametrize("environ, expected", [
    ({"WORLD_SIZE": "abc"}, ["WORLD_SIZE='abc' (from the environment)", "unset WORLD_SIZE"]),
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE='0' (from the environment)", "unset WORLD_SIZE"]),
    ({"RANK": "0"}, ["RANK=0 is set in the environment but WORLD_SIZE is not", "unset RANK",
                     "torchrun"]),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["RANK=1 and WORLD_SIZE=2 are set in the environment",
                                        "MASTER_ADDR, MASTER_PORT", "unset RANK WORLD_SIZE",
                                        "torchrun"]),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     ["RANK='x' (from the environment)", "0 <= RANK < WORLD_SIZE=2"]),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     ["RANK='2' (from the environment)", "0 <= RANK < WORLD_SIZE=2"]),
], ids=["world-abc", "world-0", "rank-alone", "no-master", "rank-x", "rank-too-big"])
def test_stray_rank_environment_is_refused_before_launch(environ, expected, launch_tripwire,
                                                         monkeypatch, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        run_in_process(tmp_path / "out")
    for part in expected:
        assert part in str(info.value), str(info.value)
    assert not (tmp_path / "out" / "resolved_config.yaml").exists()


def test_world_size_from_the_environment_is_said_and_launched(launch_tripwire, monkeypatch,
                                                              tmp_path, capsys):
    """A local run (no RANK) with WORLD_SIZE set runs that world, and says where it came from."""
    import recipes.run.launch

    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    launched = []
    monkeypatch.setattr(recipes.run.launch, "launch_local",
                        lambda path, nproc, *a, **k: launched.append(nproc))
    run_in_process(tmp_path / "out")
    out = capsys.readouterr().out
    assert launched == [4], out
    assert "world size 4 from WORLD_SIZE=4 in the environment" in out, out
    assert "parallelism.nproc_per_node=2" in out and "unset WORLD_SIZE" in out, out
    assert "layout: tp1 x dp4 (world 4)" in out, out


def test_schema_is_not_a_group_option():
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in ("model", "parallelism", "gtp", "data", "optim", "logger"):
            assert "schema" not in loader.get_group_options(group), group
        with pytest.raises(ConfigCompositionException, match="model/schema"):
            compose("config", overrides=["model=schema"])


def test_group_options_are_still_typed():
    from recipes.config.schema import ModelConfig

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        assert OmegaConf.get_type(compose("config", overrides=["model=llama_tiny"]).model) \
            is ModelConfig
        with pytest.raises(ConfigCompositionException, match="hidden_sise"):
            compose("config", overrides=["model=llama_tiny", "model.hidden_sise=3"])


@pytest.mark.parametrize("overrides, world, layout", [
    (["parallelism=tp2", "gtp=tp2_align16"], 4, (2, 2, 1)),
    (["parallelism=tp2", "parallelism.data_parallel_size=2"], 4, (2, 1, 2)),
    (["parallelism=tp1", "gtp=tp2_align16"], 2, (1, 2, 1)),
    (["parallelism=tp2pp2"], 4, (2, 1, 1)),
    (["parallelism=tp2", "gtp=tp2_align16", "parallelism.nproc_per_node=8"], 8, (2, 2, 2)),
    ([], 2, (1, 1, 2)),  # dp2 (the default) names its 2 processes
])
def test_nproc_per_node_defaults_to_the_product_of_the_degrees(overrides, world, layout):
    from compose import make_cfg

    from recipes.config.validate import validate

    cfg = make_cfg(*overrides)
    assert cfg.parallelism.nproc_per_node == world
    got = validate(cfg, cfg.parallelism.nproc_per_node)
    assert (got.tensor_model_parallel_size, got.gtp_remat_size, got.data_parallel_size) == layout


def test_warmup_past_the_run_is_clamped_with_a_note(launch_tripwire, monkeypatch, tmp_path, capsys):
    import recipes.run.launch

    started = {}
    monkeypatch.setattr(recipes.run.launch, "launch_local", lambda path, n, *rest: started.update(path=path))
    run_in_process(tmp_path, "train.train_iters=5", "optim.lr_warmup_iters=10")
    out = capsys.readouterr().out
    assert "optim.lr_warmup_iters=10 is not below train.train_iters=5" in out, out
    assert "warmup clamped to 4" in out, out
    assert OmegaConf.load(started["path"]).optim.lr_warmup_iters == 4  # what runs is recorded


def test_split_without_a_validation_document_never_hangs_the_dataset_builder(text_files, tmp_path):
    """Direct torchrun use skips train.py's checks: megatron's builder must still not loop."""
    import signal

    from compose import make_cfg

    from recipes.data import build_datasets, build_tokenizer

    cfg = make_cfg("data=text", f"data.paths=[{text_files}/one.txt]",
                   f"data.cache_dir={tmp_path}")
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("build_datasets hangs"))
    signal.alarm(60)
    try:
        with pytest.raises(ValueError, match="validation split none of the 1 document"):
            build_datasets(cfg, build_tokenizer(cfg.data), 16, 32)
    finally:
        signal.alarm(0)


def test_single_jsonl_of_several_documents_passes_the_split_check(launch_tripwire, text_files,
                                                                  tmp_path, monkeypatch):
    import recipes.run.launch

    monkeypatch.setattr(recipes.run.launch, "launch_local", lambda path, n, *rest: None)
    lines = tmp_path / "many.jsonl"
    lines.write_text("".join(f'{{"text": "{TEXT[:200]} {i}"}}\n' for i in range(60)))
    run_in_process(tmp_path / "out", "data=text", f"data.paths=[{lines}]")


def test_a_run_that_cannot_fit_this_machines_memory_is_refused_before_launch(
        monkeypatch, launch_tripwire, tmp_path):
    """On CPU every rank holds its model, optimizer state and activations in host memory: a
    ``model.seq_length`` a rotary model's checkpoint records (no stored tensor bounds it; a
    crafted 200000 made both ranks try to allocate 2.5 TB) is refused in one line naming it,
    before any process starts; the tiny model at its own length fits."""
    from compose import make_cfg

    from recipes.dry_run.sizes import check_host_memory
    from recipes.config.validate import validate

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                                                     "SC_PHYS_PAGES": (24 << 30) // 4096}[name])
    rope = ("model.position_embedding_type=rope", "checkpoint=none")
    cfg = make_cfg(*rope)
    check_host_memory(cfg, validate(cfg, 2))
    cfg = make_cfg(*rope, "model.seq_length=200000")
    with pytest.raises(ConfigError, match=r"the run needs about [\d,.]+ TiB per process .*"
                                          r"model\.seq_length=200000, .*2 processes: more than "
                                          r"this machine's 24\.00 GiB; train\.dry_run=true"):
        check_host_memory(cfg, validate(cfg, 2))
    with pytest.raises(ConfigError, match=r"model\.seq_length=200000, .*more than this machine"):
        run_in_process(tmp_path / "out", *rope, "model.seq_length=200000")  # train.py's path


def test_the_launcher_parses_a_tokenizer_json_once(monkeypatch, launch_tripwire, tmp_path):
    """The pre-launch checks, the host-memory check and the dry run each need the tokenizer's
    vocabulary: a ``tokenizer.json`` (Qwen3's: 11 MB, a second or more to parse) is read once per
    launcher, and again after it changes."""
    from chat_data import write_chat_tokenizer
    from compose import make_cfg
    from tokenizers import Tokenizer

    from recipes.data import build_tokenizer

    tok = write_chat_tokenizer(tmp_path / "tok")
    parsed = []
    real = Tokenizer.from_file
    monkeypatch.setattr(Tokenizer, "from_file", lambda f: parsed.append(f) or real(f))
    data = ("data=text", f"data.paths=[{tmp_path / 'one.txt'}]", f"data.tokenizer={tok}",
            "train.eval_iters=0")
    (tmp_path / "one.txt").write_text(TEXT * 40)
    with pytest.raises(AssertionError, match="a worker was started"):
        run_in_process(tmp_path / "out", *data)
    assert parsed == [str(tok / "tokenizer.json")]
    cfg = make_cfg(*data)
    build_tokenizer(cfg.data)
    assert len(parsed) == 1
    (tok / "tokenizer.json").write_text((tok / "tokenizer.json").read_text() + "\n")
    build_tokenizer(cfg.data)
    assert len(parsed) == 2
