#!/usr/bin/env bash
# One-GPU smoke test of the GPU path: nccl, bf16, 20 iterations saved at 10 and 20, then a resume
# from iteration 10 that must reach the same iteration-20 loss (bf16 on GPU: within 2%).
# Usage: make gpu-smoke   (or: scripts/gpu_smoke.sh [OUT_DIR])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-outputs/gpu_smoke/$(date +%Y-%m-%d_%H-%M-%S)}
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("error: make gpu-smoke needs a CUDA GPU (torch.cuda.is_available() is False)")
PYEOF
COMMON=(parallelism=tp1 precision=bf16 logger=none train.train_iters=20 optim.lr_warmup_iters=2)
"$PY" train.py hydra.run.dir="$OUT/run" "${COMMON[@]}" checkpoint.save_interval=10
"$PY" train.py hydra.run.dir="$OUT/resume" "${COMMON[@]}" checkpoint.save_interval=10 \
  checkpoint.load="$OUT/run/checkpoints" checkpoint.load_iteration=10
"$PY" - "$OUT" <<'PYEOF'
import math, sys
from recipes.metrics.logger import read_metrics
from ckpt.io import read_tracker
out = sys.argv[1]
run = {r["iteration"]: r for r in read_metrics(f"{out}/run")[0]}
res = {r["iteration"]: r for r in read_metrics(f"{out}/resume")[0]}
assert sorted(run) == list(range(1, 21)) and sorted(res) == list(range(11, 21)), (sorted(run), sorted(res))
assert read_tracker(f"{out}/resume/checkpoints") == 20
a, b = run[20]["lm loss"], res[20]["lm loss"]
assert math.isfinite(a) and math.isclose(a, b, rel_tol=0.02), (a, b)
assert run[20]["lm loss"] < run[1]["lm loss"], (run[1]["lm loss"], run[20]["lm loss"])
print(f"gpu-smoke ok: nccl, bf16, lm loss {run[1]['lm loss']:.4f} -> {a:.4f}; resumed from 10: {b:.4f}")
PYEOF
