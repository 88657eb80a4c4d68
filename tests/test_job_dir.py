"""The job dir a run claims (``recipes.run.launch.settle_job_dir``): runs started in the same second
on the default ``outputs/<date>/<time>`` each get a dir of their own (``-1``, ``-2``, ...); an
explicit dir held by a live run is refused."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict, read_write

from recipes.run import launch
from ckpt.io import lease
from recipes.config.schema import register_configs
from recipes.config.validate import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hydra_job(tmp_path, monkeypatch):
    """``hydra_job(*overrides, mode=RunMode.RUN, out=None)``: the config Hydra hands
    ``train.py``'s main, with HydraConfig set as during the job (``runtime.output_dir``: ``out``,
    else ``hydra.run.dir`` under ``tmp_path``, the working dir). Claims are given back after."""
    monkeypatch.chdir(tmp_path)
    register_configs()
    saved = HydraConfig.instance().cfg

    def make(*overrides, mode=RunMode.RUN, out=None):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            config = compose("config", overrides=["logger=none", *overrides],
                             return_hydra_config=True)
        out = out or os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.runtime.output_dir = out
            config.hydra.mode = mode
        HydraConfig.instance().set_config(config)
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        return task

    yield make
    HydraConfig.instance().cfg = saved
    while launch._HELD:
        launch._HELD.pop().release()


def _hold(path) -> lease.Lease:
    """A live claim of ``path`` held by this process (another run, as far as a taker knows)."""
    held = lease.Lease(Path(path) / launch.CLAIM)
    held.take("job dir")
    return held


def test_the_default_run_dir_is_conf_configs(hydra_job):
    conf = yaml.safe_load((REPO / "conf/config.yaml").read_text())
    assert conf["hydra"]["run"]["dir"] == launch.DEFAULT_RUN_DIR


def test_a_run_of_the_default_dir_held_by_a_live_run_takes_the_next_free_one(hydra_job):
    cfg = hydra_job()
    base = str(cfg.output_dir)
    assert re.fullmatch(r".*/outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", base), base
    first = _hold(base)
    try:
        said = launch.settle_job_dir(cfg)
        out = f"{base}-1"
        # The dir and every dir under it follow the claim; the user is told once.
        assert cfg.output_dir == out and cfg.checkpoint.save == f"{out}/checkpoints"
        assert json.loads((Path(out) / launch.CLAIM).read_text())["pid"] == os.getpid()
        assert said.count(f"job dir {base} is in use by another run") == 1, said
        assert f"this run's job dir is {out}" in said
        # Hydra's record of this run is in its own dir, naming that dir.
        record = yaml.safe_load((Path(out) / ".hydra/hydra.yaml").read_text())
        assert record["hydra"]["runtime"]["output_dir"] == out
        assert (Path(out) / ".hydra/overrides.yaml").read_text().strip() == "- logger=none"
        # A third run of that second: base and -1 are held, it takes -2.
        third = hydra_job(out=base)
        launch.settle_job_dir(third)
        assert third.output_dir == f"{base}-2"
    finally:
        first.release()


def test_a_free_default_dir_is_claimed_as_it_is(hydra_job):
    cfg = hydra_job()
    base = str(cfg.output_dir)
    assert launch.settle_job_dir(cfg) is None
    assert cfg.output_dir == base and (Path(base) / launch.CLAIM).is_file()


@pytest.mark.parametrize("how", ["hydra.run.dir", "output_dir", "multirun"])
def test_an_explicit_dir_held_by_a_live_run_is_refused(hydra_job, tmp_path, how):
    out = str(tmp_path / "shared")
    if how != "multirun":
        cfg = hydra_job(f"{how}={out}")
    else:  # a multirun's job dir, even of the default sweep dir
        cfg = hydra_job(mode=RunMode.MULTIRUN, out=out)
    assert cfg.output_dir == out
    first = _hold(out)
    try:
        with pytest.raises(ConfigError, match=rf"job dir {out} is in use by run {first.run_id}"
                                              rf".*remove {out}/{launch.CLAIM}"):
            launch.settle_job_dir(cfg)
        assert cfg.output_dir == out
        assert not Path(f"{out}-1").exists()
    finally:
        first.release()


def test_a_dry_run_claims_nothing(hydra_job):
    cfg = hydra_job("train.dry_run=true")
    launch.settle_job_dir(cfg)
    assert not (Path(cfg.output_dir) / launch.CLAIM).exists()


def _claim_in_child(base, ready, done, results):
    ready.wait()  # every child claims at once
    results.put(launch.claim_free_dir(base)[0])
    done.wait()  # each holds its claim until all have one


def test_runs_claiming_one_default_dir_at_once_each_get_their_own(tmp_path):
    """Four processes race for one dir: four distinct dirs, none refused."""
    base = str(tmp_path / "12-00-00")
    ctx = multiprocessing.get_context("fork")
    n = 4
    ready, done, results = ctx.Barrier(n), ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_child, args=(base, ready, done, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=60) for _ in range(n))
    finally:
        done.wait(timeout=60)
        for p in procs:
            p.join(30)
    assert got == [base] + [f"{base}-{i}" for i in range(1, n)]
    assert [p.exitcode for p in procs] == [0] * n


def test_the_last_free_suffix_then_a_refusal_naming_the_range(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "MAX_SUFFIX", 2)
    base = str(tmp_path / "d")
    held = [_hold(base), _hold(f"{base}-1")]
    try:
        assert launch.claim_free_dir(base)[0] == f"{base}-2"
        with pytest.raises(ConfigError, match=rf"job dir {base} and {base}-1 .. {base}-2 are all "
                                              rf"in use by live runs; set hydra.run.dir="):
            launch.claim_free_dir(base)
    finally:
        for h in held:
            h.release()
        while launch._HELD:
            launch._HELD.pop().release()


def test_a_requeue_of_this_job_on_another_host_is_not_waited_for_on_a_default_dir(tmp_path,
                                                                                  monkeypatch):
    """A live claim of this job's id on another host: an explicit dir waits for its heartbeat to
    stop (a requeue); a default dir is a new dir per start, so that holder is another run."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    base = tmp_path / "d"
    base.mkdir()
    (base / launch.CLAIM).write_text(json.dumps({"run_id": "r", "job_id": "77", "host": "n9",
                                                 "pid": 1}))
    start = time.monotonic()
    try:
        assert launch.claim_free_dir(str(base))[0] == f"{base}-1"
    finally:
        while launch._HELD:
            launch._HELD.pop().release()
    assert time.monotonic() - start < 5


@pytest.mark.e2e
def test_two_train_py_runs_in_one_second_on_the_default_dir_both_train(tmp_path, data_cache,
                                                                       train_run):
    """Two ``python train.py`` started together, no ``hydra.run.dir``: each trains in a dir of
    its own. Every ``outputs/<date>/<time>`` of the next minutes is held by this process, so
    both must move to a suffix, and they race for ``-1``. Then an explicit dir held by a live run:
    refused, rc 2, one message, no traceback."""
    now = datetime.now()
    held = [_hold(tmp_path / f"outputs/{t:%Y-%m-%d}/{t:%H-%M-%S}")
            for t in (now + timedelta(seconds=s) for s in range(-2, 180))]
    args = [sys.executable, str(REPO / "train.py"), "train.train_iters=1",
            "optim.lr_warmup_iters=1", "logger=none", "parallelism=tp1",
            f"data.cache_dir={data_cache}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        dirs = []
        for text in outs:
            base, taken = re.search(r"> note: job dir (\S+) is in use by another run started in "
                                    r"the same second; this run's job dir is (\S+)\n", text).groups()
            assert re.fullmatch(re.escape(base) + r"-\d+", taken), (base, taken)
            assert f"> job output dir: {taken}\n" in text
            resolved = yaml.safe_load((Path(taken) / "resolved_config.yaml").read_text())
            assert resolved["output_dir"] == taken
            assert resolved["checkpoint"]["save"] == f"{taken}/checkpoints"
            assert (Path(taken) / "metrics.jsonl").is_file()
            assert "this run's job dir" in (Path(taken) / "train.log").read_text()
            dirs.append(taken)
        assert len(set(dirs)) == 2, dirs
        shared = tmp_path / "shared"
        held.append(_hold(shared))
        proc = train_run(shared, rc=2)
        assert re.search(rf"^error: job dir {shared} is in use by run {held[-1].run_id}, process "
                         rf"{os.getpid()} on \S+, last heartbeat at .* \(file time\); .*remove "
                         rf"{shared / launch.CLAIM}", proc.stdout, re.M), proc.stdout[-2000:]
        assert "Traceback" not in proc.stdout and "worker" not in proc.stdout
        # Nothing of the refused run in the holder's train.log (Hydra's log handler creates it).
        assert (shared / "train.log").read_text() == ""
    finally:
        for h in held:
            h.release()
