"""Peak memory of the offline checkpoint tools (``python -m gtp convert``, ``export``,
``verify``, ``import``; the stock reader through ``convert`` of a stock checkpoint) against the
checkpoint's size and its largest tensor.

Checkpoints (one training iteration each, saved; fp32 with the Adam moments): a plain-optimizer
run at tp1 x dp2, a distributed-optimizer run at tp1 x dp2 and a stock-format one
(``checkpoint.format=stock``) at tp2 x gtp2/a16; the HF import reads the export of the first.
Each tool runs in a fresh process (:data:`benchmarks.memory.MALLOC_ENV`: freed buffers go back
to the kernel) that imports torch, megatron-core, transformers and the tool's modules first;
the figure is the peak resident memory above the RSS after those imports
(:class:`benchmarks.memory.PeakRSS`), against the checkpoint's bytes on disk (the iteration
dir) and its largest tensor (global shape x element size, from ``.metadata``).

    python -m benchmarks.tools_memory [--quick] [--out DIR] [--ckpt NAME=DIR ...]

``--quick``: the tiny model. ``--ckpt``: measure existing checkpoints (roots or iter dirs)
instead of training; ``NAME`` ``stock`` is converted, every name is verified, converted and
exported, and the first export is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.memory import MALLOC_ENV
from benchmarks.runs import REPO, write_results
from benchmarks.tables import table

# name: train.py overrides (besides the model's)
RUNS = {
    "plain": ["parallelism=tp1", "parallelism.nproc_per_node=2"],
    "distopt": ["parallelism=tp1", "parallelism.nproc_per_node=2",
                "optim.use_distributed_optimizer=true"],
    "stock": ["parallelism=tp2", "gtp=tp2_align16", "parallelism.nproc_per_node=4",
              "checkpoint.format=stock"],
}
COMMON = ["model.seq_length=32", "data.micro_batch_size=1", "data.global_batch_size=4",
          "logger=none", "train.eval_iters=0", "optim.lr_warmup_iters=1", "train.train_iters=1",
          "checkpoint.save_interval=1"]


def _train(name: str, model: str, where: Path) -> Path:
    """Train one iteration and save; returns the checkpoint root."""
    subprocess.run([sys.executable, "train.py", f"model={model}", *COMMON, *RUNS[name],
                    f"hydra.run.dir={where}"], cwd=REPO, check=True, capture_output=True)
    return where / "checkpoints"


def sizes(ckpt) -> dict:
    """``{"bytes": files of the iteration dir, "largest": bytes of the largest tensor}``."""
    from ckpt.format import safe_metadata
    from ckpt.stock import resolve_iter_dir
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve_iter_dir(ckpt)
    meta = safe_metadata.read_metadata(path)
    largest = 0
    for item in meta.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            n = item.properties.dtype.itemsize
            for d in item.size:
                n *= d
            largest = max(largest, n)
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {"bytes": total, "largest": largest}


def hf_sizes(hf_dir) -> dict:
    """:func:`sizes` of a Hugging Face model dir: its safetensors files, its largest tensor."""
    from safetensors import safe_open

    total, largest = 0, 0
    for file in Path(hf_dir).glob("*.safetensors"):
        total += file.stat().st_size
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = {"F32": 4, "BF16": 2, "F16": 2}.get(t.get_dtype(), 8)
                for d in t.get_shape():
                    n *= d
                largest = max(largest, n)
    return {"bytes": total, "largest": largest}


def _child(argv: list[str]) -> None:
    """In the measuring process: ``python -m gtp ARGV`` with the peak RSS sampled."""
    # Modules imported before the measurement starts: their code is no part of the tool's memory.
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from megatron.core import dist_checkpointing  # noqa: F401

    import recipes.families  # noqa: F401 - gives ckpt/ the model families
    from benchmarks.memory import PeakRSS
    from ckpt import cli

    with PeakRSS() as m:
        rc = cli.main(argv)
    print(json.dumps({"rc": rc, "base": m.base, "peak_delta": m.delta}))


def measure(argv: list[str]) -> dict:
    """Run ``python -m gtp ARGV`` in a measuring process; ``{"rc", "base", "peak_delta"}``."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tools_memory", "--child", *argv],
                          env={**os.environ, **MALLOC_ENV}, cwd=REPO, capture_output=True,
                          text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"gtp {argv}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools_memory")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ckpt", nargs="*", default=None, metavar="NAME=DIR")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    rows, results = [], []
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.ckpt:
            ckpts = dict(item.split("=", 1) for item in args.ckpt)
        else:
            model = "tiny" if args.quick else "gpt125m"
            ckpts = {name: str(_train(name, model, tmp / name)) for name in RUNS}
        cases = []  # (tool, checkpoint name, what it reads, command without its output)
        for name, path in ckpts.items():
            cases.append(("verify", name, path, ["verify", path]))
            cases.append(("convert", name, path, ["convert", path]))
            if name != "stock":
                cases.append(("export", name, path, ["export", path]))
        first = next(n for n in ckpts if n != "stock")
        hf = str(tmp / f"export_{first}_0")
        cases.append(("import", first, hf, ["import", hf]))
        for tool, name, path, cmd in cases:
            got = []
            for i in range(max(1, args.repeats)):
                out = [] if tool == "verify" else [str(tmp / f"{tool}_{name}_{i}")]
                got.append(measure([*cmd, *out]))
            peak = min(g["peak_delta"] for g in got)
            if tool == "import":
                size = hf_sizes(path)
            else:
                size = sizes(path)
            results.append({"tool": tool, "checkpoint": name, **size, "peak_delta": peak,
                            "base": got[0]["base"]})
            rows.append([f"gtp {tool}", name, f"{size['bytes'] / mib:.0f}",
                         f"{size['largest'] / mib:.1f}", f"{got[0]['base'] / mib:.0f}",
                         f"{peak / mib:.0f}", f"{peak / size['bytes']:.2f}",
                         f"{peak / size['largest']:.1f}"])
            print(rows[-1], flush=True)
    text = table(["tool", "checkpoint", "checkpoint MiB", "largest tensor MiB",
                  "RSS after imports MiB", "peak extra MiB", "peak / checkpoint",
                  "peak / largest tensor"], rows)
    print(text)
    if args.out:
        write_results(Path(args.out), results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
