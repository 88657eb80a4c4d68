"""Peak memory of ``python -m gtp import`` as a ratio of one layer's tensors, for a dense and a
Mixture-of-Experts model at two depths and two expert counts, and a DeepSeek-V3 (a dense first
layer, then MoE layers with a shared expert, multi-latent attention; every tensor its own key
per layer) at two depths.

Each model (transformers' ``LlamaForCausalLM`` or ``MixtralForCausalLM``, random weights, bf16,
``save_pretrained``) is imported in a fresh process (``MALLOC_ENV``: freed buffers go back to the
kernel); the peak resident memory above the process's RSS before the import
(:class:`benchmarks.memory.PeakRSS`) is printed beside one decoder layer's bytes and the two
vocabulary tensors' (embedding and output layer). Each chunk is freed once written
(``ckpt/format/dcp_writer.py``), so the peak is about the two vocabulary tensors plus one
layer's tensors, whatever the number of layers and experts: the last column,
(peak - vocabulary tensors) / one layer, stays put as the rows double the layers or experts.

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
from benchmarks.runs import write_results
from benchmarks.tables import table

# name: (family, hidden, ffn per expert or dense, layers, experts, vocab)
FULL = {
    "llama 8 layers": ("llama", 1024, 4096, 8, 0, 32000),
    "llama 16 layers": ("llama", 1024, 4096, 16, 0, 32000),
    "mixtral 4 layers x 8 experts": ("mixtral", 1024, 1024, 4, 8, 32000),
    "mixtral 8 layers x 8 experts": ("mixtral", 1024, 1024, 8, 8, 32000),
    "mixtral 4 layers x 16 experts": ("mixtral", 1024, 1024, 4, 16, 32000),
    "deepseek_v3 4 layers x 16 experts": ("deepseek_v3", 1024, 512, 4, 16, 32000),
    "deepseek_v3 8 layers x 16 experts": ("deepseek_v3", 1024, 512, 8, 16, 32000),
}
QUICK = {
    "llama 4 layers": ("llama", 256, 1024, 4, 0, 8000),
    "llama 8 layers": ("llama", 256, 1024, 8, 0, 8000),
    "mixtral 4 layers x 4 experts": ("mixtral", 256, 256, 4, 4, 8000),
    "mixtral 4 layers x 8 experts": ("mixtral", 256, 256, 4, 8, 8000),
    "deepseek_v3 4 layers x 8 experts": ("deepseek_v3", 256, 128, 4, 8, 8000),
    "deepseek_v3 8 layers x 8 experts": ("deepseek_v3", 256, 128, 8, 8, 8000),
}


def _save(root: Path, family: str, hidden: int, ffn: int, layers: int, experts: int,
          vocab: int) -> dict:
    """Save the model; returns its bytes: ``total``, ``layer`` (decoder layer 0) and ``vocab``
    (embedding + output layer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    dims = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=hidden // 64,
                num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims))
    elif family == "deepseek_v3":  # the first layer dense, MLA, a shared expert (layer 1 timed)
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        dims["num_key_value_heads"] = dims["num_attention_heads"]
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **{**dims, "intermediate_size": 4 * hidden}, moe_intermediate_size=ffn,
            n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=hidden // 2,
            kv_lora_rank=hidden // 4, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64))
    else:
        model = MixtralForCausalLM(MixtralConfig(**dims, num_local_experts=experts,
                                                 num_experts_per_tok=2, sliding_window=None))
    model = model.to(torch.bfloat16)
    model.save_pretrained(root)

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    layer = model.model.layers[1 if family == "deepseek_v3" else 0]  # an MoE layer
    return {"total": size(model), "layer": size(layer),
            "vocab": size(model.model.embed_tokens) + size(model.lm_head)}


def _child(hf_dir: str, out: str) -> None:
    """In the measuring process: import with the peak RSS sampled."""
    import recipes.families  # noqa: F401 - gives ckpt/ the model families it imports
    from benchmarks.memory import PeakRSS
    from ckpt.hf import hf_import

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
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (name, spec) in enumerate((QUICK if args.quick else FULL).items()):
            hf_dir = Path(tmp) / f"hf{n}"
            sizes = _save(hf_dir, *spec)
            peaks = []
            for i in range(max(1, args.repeats)):
                proc = subprocess.run(
                    [sys.executable, "-m", "benchmarks.hf_import_memory", "--child", str(hf_dir),
                     str(Path(tmp) / f"ckpt{n}_{i}")],
                    env={**os.environ, **MALLOC_ENV}, capture_output=True, text=True, check=True)
                peaks.append(json.loads(proc.stdout.strip().splitlines()[-1])["peak_delta"])
            peak = min(peaks)
            results[name] = {**sizes, "peak_bytes": peaks, "spec": spec}
            mib = 1 << 20
            rows.append([name, f"{sizes['total'] / mib:.0f}", f"{sizes['layer'] / mib:.1f}",
                         f"{sizes['vocab'] / mib:.0f}", f"{peak / mib:.0f}",
                         f"{peak / sizes['layer']:.1f}",
                         f"{(peak - sizes['vocab']) / sizes['layer']:.2f}"])
    text = table(["model", "weights MiB", "one layer MiB", "vocab tensors MiB",
                  "import peak MiB", "peak / one layer", "(peak - vocab) / one layer"], rows)
    print(text)
    if args.out:
        write_results(Path(args.out), results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
