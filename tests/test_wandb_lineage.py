"""Which wandb run a job writes (continue or fork) and its step counter, in one process with
wandb offline; the end-to-end crash/resume/fork files are checked in tests/test_resume.py."""

from __future__ import annotations

from omegaconf import OmegaConf

from recipes.metrics.logger import MetricLogger, plan_wandb_run
from wandb_offline import config, history, run_files


def _cfg(load, save, tmp_path, wandb=True):
    return OmegaConf.create({
        "checkpoint": {"load": None if load is None else str(load),
                       "save": None if save is None else str(save)},
        "train": {"train_iters": 10},
        "logger": {"wandb": wandb, "project": "p", "entity": None, "mode": "offline",
                   "run_name": None},
    })


def _checkpoints(root, iterations, latest):
    root.mkdir(parents=True, exist_ok=True)
    for it in iterations:
        (root / f"iter_{it:07d}").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text(str(latest))
    return root


def test_continue_only_from_the_latest_checkpoint_into_its_own_dir(tmp_path):
    ck = _checkpoints(tmp_path / "ck", [4, 8], latest=8)
    state = {"wandb_run_id": "parent01", "wandb_step": 7}
    fresh = plan_wandb_run(_cfg(None, ck, tmp_path), None, None)
    assert fresh["parent"] is None and not fresh["resume"] and len(fresh["run_id"]) == 8
    same = plan_wandb_run(_cfg(ck, ck, tmp_path), state, 8)
    assert same == {"run_id": "parent01", "resume": True, "parent": None, "saved_step": 7}
    for load_iteration, save in ((4, ck), (8, tmp_path / "elsewhere")):
        fork = plan_wandb_run(_cfg(ck, save, tmp_path), state, load_iteration)
        assert not fork["resume"] and fork["run_id"] != "parent01"
        assert fork["parent"] == {"run_id": "parent01", "iteration": load_iteration, "step": 7}


def test_a_continued_run_steps_past_rows_logged_after_the_save(tmp_path):
    """Job 1 logs iterations 1..3 (say it saved at 2, then crashed); job 2 continues from 2 and
    logs 3..4 again: wandb steps 0,1,2 then 3,4 (none a server drops), iteration as a field."""
    ck = _checkpoints(tmp_path / "ck", [2], latest=2)
    row = {"lm loss": 1.0, "grad-norm": 1.0, "num-zeros": 0.0, "learning-rate": 1e-3,
           "iteration-time": 0.1, "tokens-per-sec": 10.0, "consumed-samples": 16}
    first = MetricLogger(_cfg(None, ck, tmp_path), str(tmp_path / "job1"),
                         {"run_id": "lineage1", "resume": False, "parent": None}, {})
    for it in (1, 2, 3):
        first.log(it, row)
    first.close()
    second = MetricLogger(_cfg(ck, ck, tmp_path), str(tmp_path / "job2"),
                          {"run_id": "lineage1", "resume": True, "parent": None}, {},
                          resumed_from=2)
    for it in (3, 4):
        second.log(it, row)
    second.close()
    fork = MetricLogger(_cfg(ck, tmp_path / "other", tmp_path), str(tmp_path / "job3"),
                        {"run_id": "child001", "resume": False,
                         "parent": {"run_id": "lineage1", "iteration": 2, "step": 1}}, {})
    fork.log(3, row)
    fork.close()
    (id1, rows1), = [history(f) for f in run_files(tmp_path / "job1")]
    (id2, rows2), = [history(f) for f in run_files(tmp_path / "job2")]
    assert id1 == id2 == "lineage1"
    assert [s for s, _ in rows1 + rows2] == [0, 1, 2, 3, 4]
    assert [r["iteration"] for _, r in rows1 + rows2] == [1, 2, 3, 3, 4]
    (id3, rows3), = [history(f) for f in run_files(tmp_path / "job3")]
    cfg3 = config(run_files(tmp_path / "job3")[0])
    assert id3 == "child001" and [s for s, _ in rows3] == [2]
    assert cfg3["_wandb"]["branch_point"] == {"run_id": "lineage1", "step": 1}
    assert (cfg3["parent_run_id"], cfg3["parent_iteration"]) == ("lineage1", 2)
