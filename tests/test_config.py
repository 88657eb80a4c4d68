"""Config composition (Hydra compose API) and pre-launch validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from compose import CONF, make_cfg
from hydra.errors import ConfigCompositionException

from recipes.config.validate import ConfigError, validate


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF) / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "parallelism", "precision", "data", "optim",
                                   "checkpoint", "logger", "gtp"])
def test_every_group_option_composes_and_is_typed(group):
    assert options(group), f"conf/{group} has no options"
    for option in options(group):
        cfg = make_cfg(f"{group}={option}")
        assert cfg[group].name == option


def test_default_config_is_the_tiny_model_on_two_processes():
    cfg = make_cfg()
    parallel_dims = validate(cfg, cfg.parallelism.nproc_per_node)
    assert (cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (72, 200)
    assert cfg.model.hidden_size % 16 and cfg.model.ffn_hidden_size % 16
    assert (parallel_dims.world_size, parallel_dims.tensor_model_parallel_size,
            parallel_dims.data_parallel_size) == (2, 1, 2)


def test_checkpoints_are_saved_under_output_dir_when_it_is_set():
    """``output_dir=X`` moves the metrics and the checkpoints together: the command line a run
    prints to continue it pins ``hydra.run.dir`` to X and loads ``X/checkpoints``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=["output_dir=/tmp/elsewhere"])
    assert cfg.checkpoint.save == "/tmp/elsewhere/checkpoints"


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        make_cfg("model.bogus=1")


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="hidden_size"):
        make_cfg("model.hidden_size=abc")


def test_data_parallel_size_is_derived_from_world_size():
    cfg = make_cfg("parallelism=tp2", "parallelism.nproc_per_node=4")
    parallel_dims = validate(cfg, 4)
    assert (parallel_dims.tensor_model_parallel_size, parallel_dims.data_parallel_size) == (2, 2)


def test_virtual_pipeline_stages_are_accepted_when_layers_and_micro_batches_split():
    cfg = make_cfg("parallelism=pp2", "model.num_layers=4",
                   "parallelism.virtual_pipeline_model_parallel_size=2")
    parallel_dims = validate(cfg, 2)
    assert (parallel_dims.pipeline_model_parallel_size,
            parallel_dims.virtual_pipeline_model_parallel_size) == (2, 2)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallelism=tp2"], 3, r"world size 3 is not divisible by tensor_model_parallel_size=2"),
        (["parallelism=pp2", "model.num_layers=3"], 2,
         r"model.num_layers=3 is not divisible by pipeline_model_parallel_size=2 = 2"),
        (["parallelism=pp2", "parallelism.virtual_pipeline_model_parallel_size=2"], 2,
         r"num_layers=2 is not divisible by pipeline_model_parallel_size=2 x "
         r"virtual_pipeline_model_parallel_size=2 = 4"),
        (["parallelism=pp2", "model.num_layers=4", "parallelism.virtual_pipeline_model_parallel_size=2",
          "data.global_batch_size=3", "data.micro_batch_size=1"], 2,
         r"virtual_pipeline_model_parallel_size=2: the interleaved schedule needs the micro-batches "
         r"per step \(data.global_batch_size=3 / 1 = 3\) to be a multiple of "
         r"pipeline_model_parallel_size=2: set data.global_batch_size to a multiple of 2"),
        (["parallelism.virtual_pipeline_model_parallel_size=2"], 2,
         r"virtual_pipeline_model_parallel_size=2 needs parallelism.pipeline_model_parallel_size > 1"),
        (["gtp=tp2_align16", "model.share_embeddings_and_output_weights=true",
          "gtp.async_reduction=true"], 2,
         r"gtp.async_reduction=true cannot run here: with "
         r"model.share_embeddings_and_output_weights=true the model uses a GTP weight a second "
         r"time in one forward"),
        (["parallelism=tp2pp2"], 6, r"world size 6 is not divisible by tensor_model_parallel_size=2 x "
         r"pipeline_model_parallel_size=2 x gtp_remat_size=1 = 4"),
        (["optim.use_distributed_optimizer=true", "optim.distrib_optim_sharding_type=dp_reshardable"],
         2, r"distrib_optim_sharding_type='dp_reshardable' \(flat bucket buffers.*cannot be resumed at "
         r"another parallel layout; use 'fully_sharded_model_space' .*or 'fully_reshardable'"),
        (["parallelism.tensor_model_parallel_size=0"], 2, r"tensor_model_parallel_size=0 is invalid"),
        (["parallelism.data_parallel_size=4"], 2, r"data_parallel_size=4 does not match"),
        (["parallelism=tp4", "model.ffn_hidden_size=202"], 4, r"model.ffn_hidden_size=202 must be divisible by 4"),
        (["data.global_batch_size=10"], 2, r"global_batch_size=10 must be a multiple of"),
        (["precision.params_dtype=fp16"], 2, r"precision.params_dtype='fp16'"),
        (["optim.min_lr=1.0"], 2, r"optim.min_lr=1.0 must lie in"),
        (["data.source=hdf5"], 2, r"data.source='hdf5'"),
        (["checkpoint.keep_last=0"], 2, r"checkpoint.keep_last=0"),
        (["gtp.checkpoint_layout=padded"], 2, r"checkpoint.format='padded' \(old name gtp.checkpoint_layout\)"),
    ],
)
def test_bad_values_are_named_with_what_is_valid(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides), world)


def test_missing_checkpoint_dir_is_refused(tmp_path):
    with pytest.raises(Exception, match="no such directory"):
        validate(make_cfg(f"checkpoint.load={tmp_path}/nope"), 2)


def test_empty_checkpoint_dir_is_refused(tmp_path):
    with pytest.raises(Exception, match="has no latest_checkpointed_iteration.txt.*empty"):
        validate(make_cfg(f"checkpoint.load={tmp_path}"), 2)


@pytest.mark.parametrize("override, message", [
    ("train.log_interval=0", "train.log_interval=0 is invalid"),
    ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by=0 is invalid"),
    ("data=text", "data.paths is empty"),
])
def test_bad_values_found_only_late_are_refused_before_launch(override, message):
    cfg = make_cfg(override)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2)


def test_missing_data_file_is_refused_before_launch(tmp_path):
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/missing.jsonl]")
    with pytest.raises(ConfigError, match=r"data.paths\[0\]=.*missing.jsonl.*no such file"):
        validate(cfg, 2)


def test_jsonl_with_invalid_utf8_names_file_and_line(tmp_path):
    from recipes.data.corpus import _read_documents

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8"):
        list(_read_documents(str(path), "text"))
