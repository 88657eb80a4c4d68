"""The scheduler's job id: a save dir's lease (:mod:`ckpt.io.lease`) and a resume's requeue
check name the job that wrote it."""

from __future__ import annotations

import os


def job_id() -> str | None:
    """The scheduler's id of this job, the same for every task and after a requeue: Slurm's
    (``<array job>_<task>`` for an array task), else submitit's local executor's; None when
    neither runs this process. Never torchrun's rendezvous id: it is the literal ``none`` for
    every static-rendezvous job, so two unrelated jobs would look like one requeued job."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or None
