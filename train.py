"""Train a Megatron Core GPT as configured by conf/ (Hydra).

    python train.py                                   # tiny GPT, embedded corpus, 2 CPU processes
    python train.py parallelism=tp2 gtp=off checkpoint.load=outputs/.../checkpoints
    python train.py -m parallelism=tp1,tp2            # one job (and worker group) per value
    python train.py -m hydra/launcher=slurm parallelism=tp1,tp2   # one Slurm job per value
"""

import contextlib
import sys
import warnings

import hydra

from mcore_compat import lazy_compile
from recipes.config.schema import register_configs

# Before megatron is imported (a run that loads imports it in this process).
lazy_compile.install_if_supported()
register_configs()
# conf/hydra/launcher/submitit_local.yaml is meant to be typed by the plugin's schema of that name.
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> None:
    from recipes.metrics.console import job_log
    from recipes.run.launch import run, settle_job_dir

    with _refusal():
        # First: the claim may give this run another dir than Hydra's (two in the same second).
        notes = settle_job_dir(cfg)
    with job_log(cfg.output_dir):  # <output_dir>/train.log: a copy of the console
        if notes:
            print(notes, flush=True)
        with _refusal():
            run(cfg)


@contextlib.contextmanager
def _refusal():
    """Bad input: say what and stop (before launch, or as a torchrun rank); other errors raise."""
    from recipes.config import refusal

    try:
        yield
    except Exception as exc:
        text = refusal.message(exc)
        if text is None:
            raise
        print(f"error: {text}", file=sys.stderr)
        sys.exit(refusal.EXIT_CODE)


if __name__ == "__main__":
    main()
