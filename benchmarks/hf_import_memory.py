"""Peak memory of ``python -m gtp import`` against the model's size and its largest tensor.

A transformers ``LlamaForCausalLM`` (random weights, bf16, saved with ``save_pretrained``) is
imported in a fresh process (``MALLOC_ENV``: freed buffers go back to the kernel); the peak
resident memory above the process's RSS before the import (:class:`benchmarks.memory.PeakRSS`)
is shown side by side with the size of the weights and of the largest single tensor the import
makes (an embedding, or one layer's fused fc1). torch's DCP writer keeps the last chunk of each
checkpoint key until its file is written, so the peak is about the two vocabulary tensors plus
one layer's tensors, whatever the number of layers.

    python -m benchmarks.hf_import_memory [--quick] [--out DIR]
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
from benchmarks.tables import table

# (hidden, ffn, layers, vocab)
FULL = (1024, 4096, 8, 32000)
QUICK = (256, 1024, 4, 8000)


def _save(root: Path, hidden: int, ffn: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False)).to(torch.bfloat16)
    model.save_pretrained(root)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _child(hf_dir: str, out: str) -> None:
    """In the measuring process: import with the peak RSS sampled."""
    from benchmarks.memory import PeakRSS
    from gtp import hf_import

    # Modules imported before the measurement starts: their code is no part of the import's
    # memory (benchmarks/README.md).
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from megatron.core.dist_checkpointing import core  # noqa: F401

    with PeakRSS() as m:
        hf_import.import_hf(hf_dir, out)
    print(json.dumps({"peak_delta": m.delta}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_import_memory")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    hidden, ffn, layers, vocab = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        total = _save(hf_dir, hidden, ffn, layers, vocab)
        largest = 2 * max(vocab * hidden, 2 * ffn * hidden)  # bf16: embedding or one fc1
        peaks = []
        for i in range(max(1, args.repeats)):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.hf_import_memory", "--child", str(hf_dir),
                 str(Path(tmp) / f"ckpt{i}")],
                env={**os.environ, **MALLOC_ENV}, capture_output=True, text=True, check=True)
            peaks.append(json.loads(proc.stdout.strip().splitlines()[-1])["peak_delta"])
    peak = min(peaks)
    mib = 1 << 20
    text = table(["weights MiB", "largest tensor MiB", "import peak MiB", "peak / weights",
                  "peak / largest tensor"],
                 [[f"{total / mib:.0f}", f"{largest / mib:.0f}", f"{peak / mib:.0f}",
                   f"{peak / total:.2f}", f"{peak / largest:.2f}"]])
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(
            {"weights_bytes": total, "largest_tensor_bytes": largest, "peak_bytes": peaks,
             "shape": {"hidden": hidden, "ffn": ffn, "layers": layers, "vocab": vocab}}, indent=1))
        (out / "table.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
