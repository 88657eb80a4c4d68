"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py): a Llama
with tied embeddings (``tie_word_embeddings=true``, as Llama-3.2 1B/3B, Qwen2.5 up to 3B and
Qwen3 up to 4B ship) started from its Hugging Face weights at layouts that split it.

Under pipeline parallelism megatron keeps a copy of the tied weight on the last stage for the
output layer, stored under the embedding's name; the import stores the real vocabulary (257
rows) and the model pads it (320 rows), so that copy too must load the real rows. With lr 0 the
first ``lm loss`` is the source model's at every layout: at tp1 the output layer is the
embedding itself, so it is the reference (equal up to the order of fp32 reductions,
tests/helpers/tolerance.py); the export of the pipeline-parallel run is the source, bit for bit.

Under GTP (``gtp.tied_output``: megatron-core 0.19.2's output layer refused the embedding's GTP
shard) the same model loads at pp2 x gtp2/a16 with tp1's first loss, and a fine-tune (lr > 0)
at tp2 x gtp2/a16, where the output layer computes with the embedding's GTP shard itself, is
resumed from iteration 2 at pp2 without GTP and at pp2 x gtp2/a16 (the last stage's copy,
restored from the embedding's stored rows; with the distributed optimizer), each equal to it
over iterations 3..5.
"""

from __future__ import annotations

import pytest
import torch

from resume_checks import by_iteration
from tolerance import LLAMA_TINY, assert_fp32_close

pytestmark = pytest.mark.e2e

# The vocabulary padded only to a multiple of the TP size (257 rows at pp, 129 per rank at
# tp2), so the embedding's GTP shards hold alignment padding (to 288 / 160 rows), which the
# output layer's gather strips.
GTP2 = ["gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
        "model.make_vocab_size_divisible_by=1"]
LAYOUTS = {"tp1": ["parallelism=tp1", "parallelism.nproc_per_node=4"],
           "pp2": ["parallelism=pp2dp2"], "tp2pp2": ["parallelism=tp2pp2"],
           "pp2gtp2": ["parallelism=pp2dp2", *GTP2]}
# The fine-tune at tp2 x gtp2/a16 and its resumes from iteration RESUMED_AT.
FINE_TUNE = ["parallelism=tp2dp2", *GTP2]
RESUMES = {"ft_pp2": ["parallelism=pp2dp2"],
           "ft_pp2gtp2": ["parallelism=pp2dp2", *GTP2, "optim.use_distributed_optimizer=true"]}
RESUMED_AT = 2
# The tied Llama's parameters, its 257 vocabulary rows padded to 320: 139,904 + 63 x 64.
PARAMETERS = 143_936


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
    fine_tune = ["train.train_iters=5", "checkpoint.save_interval=2", "train.eval_iters=0"]
    train_jobs([(root / name, [*common, *layout, f"checkpoint.save={root / name / 'ckpt'}"])
                for name, layout in LAYOUTS.items()]
               + [(root / "ft", [*fine_tune, f"checkpoint.pretrained={root / 'hf'}",
                                 *FINE_TUNE])]
               + [(root / name, [*fine_tune, *layout, f"checkpoint.load={root / 'ft'}/checkpoints",
                                 f"checkpoint.load_iteration={RESUMED_AT}"])
                  for name, layout in RESUMES.items()])
    return root


@pytest.mark.parametrize("layout", ["pp2", "tp2pp2", "pp2gtp2"])
def test_tied_weights_load_into_a_pipeline_parallel_model(tied, layout):
    want = by_iteration(tied / "tp1")[0][1]["lm loss"]
    got = by_iteration(tied / layout)[0][1]["lm loss"]
    assert_fp32_close(got, want, 1, LLAMA_TINY, what=(layout,))


def test_tied_export_after_tp2pp2_is_the_source(tied):
    from safetensors.torch import load_file

    from ckpt import cli

    assert cli.main(["export", str(tied / "tp2pp2" / "ckpt"), str(tied / "exported")]) == 0
    src = load_file(tied / "hf" / "model.safetensors")
    back = load_file(tied / "exported" / "model.safetensors")
    assert sorted(back) == sorted(src) and "lm_head.weight" not in src
    for key, tensor in src.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", RESUMES)
def test_a_tied_fine_tune_at_tp2_gtp2_resumes_at_pp2_with_and_without_gtp(tied, name):
    from resume_checks import assert_same_step

    want, _ = by_iteration(tied / "ft")
    got, events = by_iteration(tied / name)
    assert sorted(want) == [1, 2, 3, 4, 5] and sorted(got) == [3, 4, 5]
    assert events[0]["event"] == "resume" and events[0]["iteration"] == RESUMED_AT
    for it in (3, 4, 5):
        assert_same_step(got[it], want[it], steps=it - RESUMED_AT, terms=PARAMETERS)
    assert want[5]["lm loss"] < want[1]["lm loss"]  # lr > 0 moved the weights
