"""From a composed Hydra config to running workers.

:func:`run` validates the whole config in the Hydra process, writes the resolved config into the
job's output dir, then either starts ``nproc_per_node`` workers on this machine with torch's
elastic launcher (torchrun's library API) or, when RANK/WORLD_SIZE are already set (torchrun or
Slurm across nodes), runs this process as that rank.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from recipes.validate import validate, world_size_from_env
from recipes.worker import RESOLVED_CONFIG

# A worker that died takes the others down within this many seconds (elastic agent's monitor).
MONITOR_INTERVAL_S = 0.5


def write_resolved_config(cfg, output_dir: str) -> Path:
    """Write ``cfg`` with every interpolation resolved to ``<output_dir>/resolved_config.yaml``."""
    path = Path(output_dir) / RESOLVED_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(tmp, path)
    return path


def launch_local(config_path: Path, nproc: int) -> None:
    """Start ``nproc`` workers on this machine and wait for them.

    Raises:
        SystemExit(1): a worker failed; its error (the first failure) is printed first.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "recipes.worker", str(config_path))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"\nerror: worker rank {rank} failed (exit code {failure.exitcode}):", file=sys.stderr)
        print(failure.message if isinstance(failure.message, str) else failure.message.get(
            "message", failure.message), file=sys.stderr)
        raise SystemExit(1) from None


def run(cfg) -> None:
    """Validate ``cfg``, write it resolved, and run the job (local launch or as one rank)."""
    layout = validate(cfg, world_size_from_env(cfg))
    config_path = write_resolved_config(cfg, cfg.output_dir)
    print(f"> job output dir: {cfg.output_dir}\n> layout: {layout.describe()}", flush=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from recipes.worker import run as run_worker

        run_worker(OmegaConf.load(config_path))
    else:
        launch_local(config_path, cfg.parallelism.nproc_per_node)
