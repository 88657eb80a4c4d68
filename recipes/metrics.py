"""Per-iteration metrics on rank 0: a local JSONL file, wandb, and a progress line.

Names follow Megatron-LM: ``lm loss``, ``grad-norm``, ``learning-rate``, ``iteration-time``
(seconds), ``num-zeros``, ``tokens-per-sec``, ``consumed-samples``; the step is ``iteration``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
# wandb run modes ``logger.mode`` may take.
LOGGER_MODES = ("offline", "online", "disabled")


def new_run_id() -> str:
    """A fresh wandb-compatible run id (8 lowercase alphanumerics), the same on every rank
    (drawn on rank 0 and broadcast: it is part of the checkpoint's common state)."""
    import secrets
    import string

    import torch

    alphabet = string.ascii_lowercase + string.digits
    box = ["".join(secrets.choice(alphabet) for _ in range(8))]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class MetricLogger:
    """Writes ``<output_dir>/metrics.jsonl`` and, when ``logger.wandb``, one wandb run.

    Only construct it on global rank 0 (exactly one wandb run per job).

    Args:
        cfg: the run config (``logger`` group).
        output_dir: the job's output dir.
        run_id: the wandb run id; the same id on resume continues the same run and chart.
        config: resolved config dict stored in the wandb run.
    """

    def __init__(self, cfg, output_dir: str, run_id: str, config: dict):
        self.train_iters = cfg.train.train_iters
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self.run = None
        if cfg.logger.wandb:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=cfg.logger.project,
                entity=cfg.logger.entity,
                name=cfg.logger.run_name,
                id=run_id,
                resume="allow",
                mode=cfg.logger.mode,
                dir=str(output_dir),
                config=config,
            )

    def event(self, kind: str, **fields) -> None:
        """Record a non-metric event (``start``, ``resume``, ``save``) in the JSONL file."""
        self._file.write(json.dumps({"event": kind, **fields}) + "\n")

    def log(self, iteration: int, metrics: dict) -> None:
        """Record ``metrics`` at step ``iteration`` and print a progress line."""
        self._file.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=iteration)
        print(format_progress(iteration, self.train_iters, metrics), flush=True)

    def close(self) -> None:
        """Flush and finish the wandb run."""
        self._file.close()
        if self.run is not None:
            self.run.finish()


def format_progress(iteration: int, total: int, m: dict) -> str:
    """One Megatron-style progress line."""
    return (
        f" iteration {iteration:6d}/{total} | consumed samples {m['consumed-samples']:8d} | "
        f"elapsed time per iteration (ms): {1000 * m['iteration-time']:8.1f} | "
        f"tokens/s: {m['tokens-per-sec']:9.0f} | learning rate: {m['learning-rate']:.4E} | "
        f"lm loss: {m['lm loss']:.6E} | grad norm: {m['grad-norm']:.4f} | "
        f"num zeros: {m['num-zeros']:.0f}"
    )


def read_metrics(output_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Read a job's ``metrics.jsonl``: ``(metric rows, event rows)`` in file order."""
    rows, events = [], []
    with open(Path(output_dir) / METRICS_FILE) as f:
        for line in f:
            rec = json.loads(line)
            (events if "event" in rec else rows).append(rec)
    return rows, events
