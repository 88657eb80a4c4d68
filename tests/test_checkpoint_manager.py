"""The checkpoint manager's resume: each rank of a torchrun-style job (every rank runs its own
pre-launch checks, then trains in the same process) checks the checkpoint it loads, verifies
its bytes and reads its common state once."""

from __future__ import annotations

import pytest
from multiproc import run_distributed

from conftest import FAST


def _run_counting(out: str, data_cache: str, *overrides: str) -> dict:
    """One rank of a world-2 job (``recipes.run.launch.run``, as under torchrun) with counters on
    the leaf of each loadability check: the storage check of ``check_loadable``, the byte
    verification and megatron's read of the common state."""
    from megatron.core import dist_checkpointing

    from compose import make_cfg
    from ckpt import verify
    from recipes.run import launch
    from ckpt.io import integrity

    counts = {"check_loadable": 0, "verify": 0, "load_common": 0}

    def counting(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    integrity.check_storage = counting("check_loadable", integrity.check_storage)
    verify.check_share = counting("verify", verify.check_share)
    dist_checkpointing.load_common_state_dict = counting(
        "load_common", dist_checkpointing.load_common_state_dict)
    cfg = make_cfg("parallelism=dp2", *FAST, f"output_dir={out}", f"data.cache_dir={data_cache}",
                   f"checkpoint.save={out}/checkpoints", *overrides)
    launch.run(cfg)
    return counts


@pytest.mark.multiprocess
def test_a_resume_checks_and_reads_its_checkpoint_once_per_rank(tmp_path, data_cache):
    root = tmp_path / "checkpoints"
    fresh = run_distributed(_run_counting, 2, str(tmp_path), str(data_cache),
                            "train.train_iters=2", "checkpoint.save_interval=2", timeout=600)
    assert fresh == [{"check_loadable": 0, "verify": 0, "load_common": 0}] * 2
    resumed = run_distributed(_run_counting, 2, str(tmp_path), str(data_cache),
                              "train.train_iters=3", "checkpoint.save_interval=0",
                              f"checkpoint.load={root}", timeout=600)
    assert resumed == [{"check_loadable": 1, "verify": 1, "load_common": 1}] * 2
