"""The golden loss curve: a fixed small run whose every logged ``lm loss`` and ``grad-norm`` is
kept in ``tests/golden/loss_curve.json``, so that a change in numerics is never silent.

Regenerate with ``make golden`` after a change that is meant to move the numerics, and say why
in the commit. Another CPU's kernels round differently: tests/test_resume_exact.py compares
within ``tolerance.fp32_rtol`` (docs/testing.md), so that is no reason to regenerate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "loss_curve.json"
# The tiny GPT at dp2 (the defaults), fp32, plain Adam; saves at 3 (tests/test_resume_exact.py
# resumes from it).
OVERRIDES = ["train.train_iters=6", "optim.lr_warmup_iters=1", "optim.lr_decay_iters=6",
             "logger=none", "checkpoint.save_interval=3", "train.eval_interval=0"]
KEYS = ("lm loss", "grad-norm", "learning-rate", "num-zeros")


def curve(rows: list[dict]) -> dict:
    """``{iteration: {key: value}}`` of a run's metric rows (the keys of :data:`KEYS`)."""
    return {str(r["iteration"]): {k: r[k] for k in KEYS} for r in rows}


def main() -> None:
    """Run the golden config through train.py and write :data:`GOLDEN`."""
    sys.path.insert(0, str(REPO))
    from recipes.metrics.logger import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp}", *OVERRIDES],
                       cwd=REPO, check=True, env={**os.environ, "WANDB_SILENT": "true"})
        rows, _ = read_metrics(tmp)
    GOLDEN.write_text(json.dumps(curve(rows), indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
