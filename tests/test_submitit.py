"""Hydra's submitit launcher: the Slurm config's submission (sbatch) parameters, and a real
submitit sweep with the local executor whose jobs train, save, and one of which is resumed."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from compose import CONF
from recipes.metrics.logger import read_metrics
from recipes.report import find_job_dirs


def test_slurm_launcher_submits_one_task_per_rank(tmp_path, monkeypatch):
    """The launcher's own code path up to the submission: its executor's sbatch script asks for
    nodes x nproc_per_node tasks and the cluster fields given on the command line."""
    import submitit

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", "parallelism=tp2dp2", "hydra.launcher.nodes=2",
            "hydra.launcher.partition=gpu", "hydra.launcher.account=proj",
            "hydra.launcher.gpus_per_node=4", "hydra.launcher.timeout_min=30",
            f"hydra.sweep.dir={tmp_path}", "hydra.job.name=train"])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    launcher.config = cfg
    captured = {}

    def capture(executor, fn, *args):
        captured["executor"], captured["args"] = executor, args
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    # No Slurm here: submitit's check for srun on this machine is the one thing bypassed.
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    launcher.launch([["parallelism=tp2dp2"]], initial_job_idx=0)
    script = captured["executor"]._executor._make_submission_file_text("python -u x.py", "uid")
    lines = set(script.splitlines())
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --gpus-per-node=4", "#SBATCH --time=30"):
        assert want in lines, (want, script)
    assert any(line.startswith(f"#SBATCH --output={tmp_path}/.submitit/") for line in lines), script
    # One srun task per rank: srun starts ntasks-per-node x nodes processes.
    assert any(line.startswith("srun ") for line in lines), script


@pytest.mark.e2e
def test_submitit_local_sweep_trains_saves_and_resumes(train_run, tmp_path):
    """``train.py -m hydra/launcher=submitit_local parallelism=tp1,tp2``: both jobs run as
    submitit tasks (2 per job, each its global rank), train and save; job 1 is then resumed in
    a second submitit sweep into its own checkpoint dir."""
    sweep = tmp_path / "sweep"
    train_run(sweep, "hydra/launcher=submitit_local", "parallelism=tp1,tp2",
              "hydra.sweep.subdir=${hydra.job.num}", multirun=True)
    assert sorted(p.name for p in (sweep / ".submitit").iterdir()), "no submitit job folder"
    jobs = sorted(find_job_dirs([sweep]))
    assert [j.name for j in jobs] == ["0", "1"]
    for job, tp in zip(jobs, (1, 2)):
        rows, events = read_metrics(job)
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
        assert "lm loss validation" in rows[-1]
        layout = next(e["layout"] for e in events if e["event"] == "start")
        # The job's world is submitit's tasks: tasks_per_node (2) x nodes (1).
        assert (layout["world_size"], layout["tensor_model_parallel_size"]) == (2, tp)
        assert (job / "checkpoints" / "iter_0000004").is_dir()
    ckpt = jobs[1] / "checkpoints"
    resumed = tmp_path / "resumed"
    train_run(resumed, "hydra/launcher=submitit_local", "parallelism=tp2", "train.train_iters=6",
              f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}",
              "hydra.sweep.subdir=${hydra.job.num}", multirun=True)
    rows, events = read_metrics(resumed / "0")
    assert [r["iteration"] for r in rows] == [5, 6]
    assert next(e for e in events if e["event"] == "resume")["iteration"] == 4
    assert (ckpt / "iter_0000006").is_dir()
