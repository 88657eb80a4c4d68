"""Every bad input a newcomer tries is refused before any worker starts, naming the value and a fix.

Most cases run ``recipes.run.launch.run`` in this process, as ``train.py`` calls it (Hydra's compose
API, Hydra's runtime config installed so experiment names and choices are seen), with the local
launcher replaced by a tripwire; a few run ``train.py`` itself to see exit code 2 and no traceback.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from prelaunch import launch_tripwire, run_in_process, write_text_files  # noqa: F401 (fixture)

from ckpt.io import CheckpointError
from recipes.config.validate import ConfigError


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return write_text_files(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A tiny model's checkpoint (2 iterations, 1 process)."""
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path_factory.mktemp("ckpt_src")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={out}", "parallelism=tp1",
         "train.train_iters=2", "optim.lr_warmup_iters=1", "logger=none",
         f"data.cache_dir={out}/cache", "train.eval_iters=0", "logger.console_line=full"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    (out / "console.txt").write_text(proc.stdout)
    return out / "checkpoints"


def test_the_console_of_a_run_is_quiet_and_copied_to_train_log(checkpoint_dir):
    """The checkpoint fixture's run (logger=none, synchronous saves, the full iteration line)."""
    console = (checkpoint_dir.parent / "console.txt").read_text()
    assert "async save is deprecated" not in console, console
    assert "wandb run" not in console, console
    assert "throughput per GPU (TFLOP/s/GPU)" in console and "peak memory per rank" in console
    assert "| number of skipped iterations: 0" in console, console
    log = (checkpoint_dir.parent / "train.log").read_text()
    assert " iteration      2/2" in log and "> saved checkpoint at iteration 2" in log, log
    # The seconds a save took, and the closing summary naming the checkpoint to resume from.
    assert re.search(r"^> saved checkpoint at iteration 2 to \S+iter_0000002 in \d+\.\d s$", log,
                     re.M), log
    assert re.search(r"^> run complete: iteration 2/2 in \d+:\d\d:\d\d \(wall time\)\n"
                     r">   final lm loss: \S+\n(>   lm loss validation: .*\n)?"
                     r">   resume from: \S+iter_0000002\n>   train on with: python \S*train.py .*"
                     r"checkpoint.load=auto train.train_iters=4$", log, re.M), log
    assert "wandb sync" not in log  # logger=none


# (overrides, substrings of the message: the bad value and the fix). {t}: text files dir,
# {c}: a tiny model's checkpoint, {e}: an empty dir.
CASES = [
    (["experiment=nope"], ["experiment=nope does not exist", "cpu_alignment_sweep"]),
    (["experiment=llama3_8b_tp4_gtp2_fp"], ["experiment=llama3_8b_tp4_gtp2_fp ",
                                            "did you mean experiment=llama3_8b_tp4_gtp2_fp8"]),
    (["+train.trian_iters=12"], ["train.trian_iters is not a config field",
                                 "did you mean train.train_iters"]),
    (["+model.hidden_sise=96"], ["model.hidden_sise", "did you mean model.hidden_size"]),
    (["+train.micro_batch_size=2"], ["train.micro_batch_size", "did you mean data.micro_batch_size"]),
    (["+foo=1"], ["foo is not a config field", "valid keys of the config"]),
    # megatron's scatter to the sequence-parallel region asserted on every rank after launch
    (["parallelism=tp2", "parallelism.sequence_parallel=true", "model.seq_length=63"],
     ["model.seq_length=63 must be divisible by tensor_model_parallel_size=2",
      "model.seq_length=62"]),
    (["data=text", "data.paths=[{t}/one.txt]"],
     ["data.split='98,2,0' gives the validation split none of the 1 document",
      "train.eval_iters=0"]),
    (["data=text", "data.paths=[{t}/one.txt,{t}/two.txt]"],
     ["validation split none of the 2 document", "data.split=74/26/0"]),
    (["data=text", "data.paths=[{t}/one.txt,{t}/two.txt]", "data.split=10/90/0"],
     ["data.split='10/90/0' gives the train split none of the 2", "data.split=74/26/0"]),
    (["data.split=0/100/0"], ["data.split='0/100/0'", "train > 0 (e.g. '98,2,0')"]),
    (["data.split=abc"], ["data.split='abc'", "e.g. '98,2,0'"]),
    (["train.eval_iters=2", "data.split=100/0/0"], ["data.split='100/0/0'", "train.eval_iters=0"]),
    (["data=text"], ["data.paths is empty", "needs files with suffix in ('.txt', '.jsonl')"]),
    (["data=text", "data.paths=[{t}/nope.csv]"], ["nope.csv", "valid are ('.txt', '.jsonl')"]),
    (["data=indexed", "data.vocab_size=257", "data.eod_id=256", "data.paths=[{t}/one.bin]"],
     ["one.bin", "drop the .bin/.idx suffix"]),
    (["data=indexed", "data.paths=[{t}/x]"], ["data.vocab_size is null", "vocab_size=257, eod_id=256"]),
    (["data.tokenizer=/nope/tokenizer.json"],
     ["data.tokenizer='/nope/tokenizer.json'", "a path to a Hugging Face tokenizer.json"]),
    (["data.tokenizer={e}"], ["data.tokenizer=", "no such tokenizer.json file or directory holding one"]),
    (["logger=wandb", "logger.mode=online"],
     ["logger.mode=online needs wandb credentials", "export WANDB_API_KEY", "logger.mode=offline"]),
    (["logger=wandb", "logger.mode=onlin"], ["logger.mode='onlin'", "valid are"]),
    (["logger.console_line=wide"], ["logger.console_line='wide'", "valid are ('compact', 'full')"]),
    (["checkpoint.load={c}", "model.hidden_size=96"],
     ["model.hidden_size=96 (checkpoint: 72)", "set model.hidden_size=72", "checkpoint.load=null"]),
    (["checkpoint.load={c}", "model=tiny_swiglu"], ["model.swiglu=True (checkpoint: False)",
                                                    "set model.swiglu=false"]),
    (["checkpoint.load={c}", "model.num_layers=3"], ["model.num_layers=3 (checkpoint: 2)",
                                                     "set model.num_layers=2"]),
    (["checkpoint.pretrained={t}/nothf"],
     ["checkpoint.pretrained={t}/nothf", "{t}/nothf/config.json is not a Hugging Face model "
      "config (no model_type)", "config.json with model_type deepseek_v3 or glm4_moe or gpt2 or llama"]),
    (["checkpoint.load={e}"], ["has no latest_checkpointed_iteration.txt", "empty"]),
    (["checkpoint.load={e}/missing"], ["missing", "no such directory"]),
    (["parallelism=tp2", "parallelism.nproc_per_node=3"],
     ["world size 3 is not divisible", "parallelism.nproc_per_node=2"]),
    (["parallelism.data_parallel_size=3", "parallelism.nproc_per_node=2"],
     ["parallelism.data_parallel_size=3", "set it to 2 or null"]),
    (["parallelism=pp2", "model.num_layers=3"], ["model.num_layers=3", "multiple of 2"]),
    (["parallelism.virtual_pipeline_model_parallel_size=2"],
     ["virtual_pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=null"]),
    (["train.train_iters=0"], ["train.train_iters=0 is invalid", ">= 1"]),
    (["optim.lr_warmup_iters=-1"], ["optim.lr_warmup_iters=-1", "must lie in [0, 4)"]),
    (["optim.min_lr=1"], ["optim.min_lr=1", "[0, optim.lr=0.003]"]),
    (["optim.lr_decay_style=cosin"], ["optim.lr_decay_style='cosin'", "valid are"]),
    (["optim.optimizer=sgd"], ["optim.optimizer='sgd'", "valid are ('adam', 'muon')"]),
    (["optim.use_distributed_optimizer=true", "optim.distrib_optim_sharding_type=dp_reshardable"],
     ["'dp_reshardable'", "use 'fully_sharded_model_space'", "or 'fully_reshardable'"]),
    (["precision.params_dtype=fp16"], ["precision.params_dtype='fp16'", "valid are"]),
    (["data.global_batch_size=10"], ["data.global_batch_size=10", "must be a multiple of"]),
    (["data.micro_batch_size=0"], ["data.micro_batch_size=0 is invalid", ">= 1"]),
    (["model.num_attention_heads=5"], ["model.hidden_size=72", "divisible by model.num_attention_heads=5"]),
    (["model.normalization=BatchNorm"], ["model.normalization='BatchNorm'", "valid are"]),
    (["model.recompute_granularity=some"], ["model.recompute_granularity='some'", "'selective'"]),
    (["model=llama_tiny", "model.num_query_groups=4"], ["num_query_groups=4", "must divide"]),
    (["gtp.quantization=fp9"], ["gtp.quantization='fp9'", "fp8"]),
    (["gtp.checkpoint_layout=padded"], ["gtp.checkpoint_layout='padded'", "valid are"]),
    (["checkpoint.save_interval=-1"], ["checkpoint.save_interval=-1", "must be >= 0"]),
    (["checkpoint.keep_last=0"], ["checkpoint.keep_last=0", ">= 1 or null"]),
    (["train.log_interval=0"], ["train.log_interval=0 is invalid", ">= 1"]),
]


def _fill(items, text_files, checkpoint: str, empty) -> list[str]:
    return [s.replace("{t}", str(text_files)).replace("{c}", checkpoint).replace("{e}", str(empty))
            for s in items]


# Cases that need a trained checkpoint (a train.py run) are left out of `make test-fast`.
@pytest.mark.parametrize("overrides, expected", [
    pytest.param(o, e, id=" ".join(o), marks=[pytest.mark.e2e] if any("{c}" in x for x in o) else [])
    for o, e in CASES])
def test_bad_input_is_refused_before_launch(overrides, expected, launch_tripwire, text_files,
                                            tmp_path, request):
    checkpoint = str(request.getfixturevalue("checkpoint_dir")) if any(
        "{c}" in o for o in overrides) else ""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    with pytest.raises((ConfigError, CheckpointError)) as info:
        run_in_process(out, *_fill(overrides, text_files, checkpoint, empty))
    message = str(info.value)
    for part in _fill(expected, text_files, checkpoint, empty):
        assert part in message, message
    assert not (out / "resolved_config.yaml").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, expected, environ", [
    (["data=text", "data.paths=[{t}/one.txt]"], "train.eval_iters=0", {}),
    (["experiment=nope"], "experiment=nope does not exist", {}),
    (["+train.trian_iters=12"], "did you mean train.train_iters", {}),
    (["logger=wandb", "logger.mode=online"], "export WANDB_API_KEY", {}),
    (["checkpoint.pretrained={t}/nothf"], "is not a Hugging Face model config", {}),
    ([], "WORLD_SIZE='abc' (from the environment)", {"WORLD_SIZE": "abc"}),
], ids=["single-txt", "experiment", "plus-key", "wandb-online", "not-hf-config", "world-abc"])
def test_train_py_exits_2_without_traceback(overrides, expected, environ, train_run, text_files,
                                            tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["NETRC"] = "/nonexistent/netrc"
    proc = train_run(tmp_path, *_fill(overrides, text_files, "", tmp_path), rc=2, timeout=120,
                     env={**env, **environ})
    expected = _fill([expected], text_files, "", tmp_path)[0]
    assert f"error: " in proc.stdout and expected in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout and proc.stdout.count("error: ") == 1, proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()
    assert expected in (tmp_path / "train.log").read_text()  # the job's log holds the refusal


def test_resume_with_the_checkpoint_schedule_is_not_refused_for_warmup(
        launch_tripwire, monkeypatch, tmp_path, checkpoint_dir, capsys):
    import recipes.run.launch

    started = {}
    monkeypatch.setattr(recipes.run.launch, "launch_local", lambda path, n, *rest: started.update(path=path))
    run_in_process(tmp_path, "parallelism=tp1", "train.train_iters=3", "optim.lr_warmup_iters=10",
                   f"checkpoint.load={checkpoint_dir}")
    ran = OmegaConf.load(started["path"])
    assert ran.optim.lr_warmup_iters == 1, "the checkpoint's schedule (warmup 1) runs"
    assert "clamped" not in capsys.readouterr().out


def _with_saved_model(checkpoint_dir: Path, tmp_path: Path, drop=(), **fields) -> Path:
    """A copy of ``checkpoint_dir`` whose common state's saved run config has ``fields`` in its
    ``model`` group and not the keys ``drop`` (the data file's records and ``.metadata``'s
    offsets rewritten to match: every CRC-32 and offset check holds)."""
    import io
    import pickle
    import shutil

    import torch

    from ckpt.format.safe_metadata import read_metadata
    from ckpt.format.safe_objects import load_object

    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoint_dir, root)
    path = root / "iter_0000002"
    metadata = read_metadata(path)
    fqn, target = next((index.fqn, info) for index, info in metadata.storage_data.items()
                       if index.fqn.startswith("common_state/"))
    infos = sorted((info for info in metadata.storage_data.values()
                    if info.relative_path == target.relative_path), key=lambda i: i.offset)
    old = (path / target.relative_path).read_bytes()
    stored = load_object(io.BytesIO(old[target.offset:target.offset + target.length]), fqn)
    common = stored[0]  # megatron stores the common state as the record's element 0
    config = common["train_state"]["config"]
    common["train_state"] = {**common["train_state"],
                             "config": {**config, "model": {
                                 k: v for k, v in {**config["model"], **fields}.items()
                                 if k not in drop}}}
    blob = io.BytesIO()
    torch.save(stored, blob)
    out = bytearray()
    for info in infos:
        data = blob.getvalue() if info is target else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(data)
        out += data
    (path / target.relative_path).write_bytes(bytes(out))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return root


@pytest.mark.e2e
@pytest.mark.parametrize("field, value", [("num_layers", 1_000_000_000),
                                          ("num_moe_experts", 1_000_000_000),
                                          ("hidden_size", 100_000)])
def test_a_saved_size_beyond_the_stored_shapes_is_refused_before_shapes_are_enumerated(
        field, value, checkpoint_dir, launch_tripwire, tmp_path):
    """A common state whose saved run config says ``model.num_layers=1000000000``: a resume
    takes the value (not given here) and is refused in one line naming it, before any
    parameter shape is enumerated (each layer's would be: a MemoryError); ``gtp verify`` says
    DAMAGED and ``gtp export`` refuses it. A size within every stored dim but not the model's (hidden 100000 in a
    checkpoint whose largest dim is smaller) is refused the same way."""
    import contextlib
    import io

    from ckpt import cli

    root = _with_saved_model(checkpoint_dir, tmp_path, **{field: value})
    with pytest.raises(CheckpointError) as info:
        run_in_process(tmp_path / "out", f"checkpoint.load={root}")
    message = str(info.value)
    assert "\n" not in message, message
    assert f"its saved run config has model.{field}={value}, larger than any stored" in message
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        assert cli.main(["verify", str(root)], out=out) == 1, out.getvalue()
    assert re.search(rf"DAMAGED {re.escape(str(root))}/iter_0000002: object 'common_state': its "
                     rf"saved run config has model\.{field}={value}, larger", out.getvalue()), \
        out.getvalue()
    # gtp export too, before a size builds anything (a vocabulary of 10**9: 288 GB asked).
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        assert cli.main(["export", str(root), str(tmp_path / "hf")], out=out) == 2
    assert re.search(rf"error: .*iter_0000002: its saved run config has model\.{field}={value}, "
                     rf"larger .*; export another checkpoint", out.getvalue()), out.getvalue()


@pytest.mark.e2e
def test_a_checkpoint_saved_before_model_family_resumes_as_its_family(
        checkpoint_dir, launch_tripwire, monkeypatch, tmp_path, capsys):
    """A run saved before ``model.family`` existed (no ``family`` in its saved model config):
    the resume passes every pre-launch check, with the family its fields imply and no changed
    model field reported."""
    import recipes.run.launch

    root = _with_saved_model(checkpoint_dir, tmp_path, drop=("family",))
    started = {}
    monkeypatch.setattr(recipes.run.launch, "launch_local",
                        lambda path, n, *rest: started.update(path=path))
    run_in_process(tmp_path / "out", "parallelism=tp1", "train.train_iters=3",
                   f"checkpoint.load={root}")
    assert OmegaConf.load(started["path"]).model.family == "gpt"
    out = capsys.readouterr().out
    assert "changed config" in out and "model." not in out, out  # train_iters, the schedule


@pytest.mark.e2e
def test_more_parameters_than_the_checkpoint_stores_is_refused(checkpoint_dir, launch_tripwire,
                                                                tmp_path):
    """Every size within the stored dims, but layers of hidden 320 (the largest stored dim, the
    padded vocabulary's) and ffn 320: more parameter elements than all stored tensors hold."""
    root = _with_saved_model(checkpoint_dir, tmp_path, num_layers=64, hidden_size=320,
                             ffn_hidden_size=320, num_attention_heads=4)
    with pytest.raises(CheckpointError, match=r"its saved run config's model has \d+ parameter "
                                              r"elements, more than all \d+ stored tensors hold"):
        run_in_process(tmp_path / "out", f"checkpoint.load={root}")
