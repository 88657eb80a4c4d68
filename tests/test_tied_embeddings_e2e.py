"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py): a Llama
with tied embeddings (``tie_word_embeddings=true``, as Llama-3.2 1B/3B, Qwen2.5 up to 3B and
Qwen3 up to 4B ship) started from its Hugging Face weights at layouts that split it.

Under pipeline parallelism megatron keeps a copy of the tied weight on the last stage for the
output layer, stored under the embedding's name; the import stores the real vocabulary (257
rows) and the model pads it (320 rows), so that copy too must load the real rows. With lr 0 the
first ``lm loss`` is the source model's at every layout: at tp1 the output layer is the
embedding itself, so it is the reference (equal up to the order of fp32 reductions,
tests/helpers/tolerance.py); the export of the pipeline-parallel run is the source, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from resume_checks import by_iteration
from tolerance import LLAMA_TINY, assert_fp32_close

pytestmark = pytest.mark.e2e

LAYOUTS = {"tp1": ["parallelism=tp1", "parallelism.nproc_per_node=4"],
           "pp2": ["parallelism=pp2dp2"], "tp2pp2": ["parallelism=tp2pp2"]}


@pytest.fixture(scope="module")
def tied(train_jobs, tmp_path_factory):
    """A tied 4-layer Llama saved by transformers, and one lr-0 iteration from it per layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=256, eos_token_id=256,
    )).save_pretrained(root / "hf")
    common = [f"checkpoint.pretrained={root / 'hf'}", "optim.lr=0", "optim.min_lr=0",
              "optim.lr_warmup_iters=0", "train.train_iters=1", "train.eval_iters=0"]
    train_jobs([(root / name, [*common, *layout, f"checkpoint.save={root / name / 'ckpt'}"])
                for name, layout in LAYOUTS.items()])
    return root


@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_tied_weights_load_into_a_pipeline_parallel_model(tied, layout):
    want = by_iteration(tied / "tp1")[0][1]["lm loss"]
    got = by_iteration(tied / layout)[0][1]["lm loss"]
    assert_fp32_close(got, want, 1, LLAMA_TINY, what=(layout,))


def test_tied_export_after_tp2pp2_is_the_source(tied):
    from safetensors.torch import load_file

    from gtp import cli

    assert cli.main(["export", str(tied / "tp2pp2" / "ckpt"), str(tied / "exported")]) == 0
    src = load_file(tied / "hf" / "model.safetensors")
    back = load_file(tied / "exported" / "model.safetensors")
    assert sorted(back) == sorted(src) and "lm_head.weight" not in src
    for key, tensor in src.items():
        assert torch.equal(back[key], tensor), key
