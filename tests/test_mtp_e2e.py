"""End to end (each job run as train.py's workers run it, tests/helpers/inworld.py): a Llama with
one multi-token prediction layer (``model.mtp_num_layers=1``, DeepSeek-V3's MTP, megatron's
``MultiTokenPredictionBlock``) trained at tp1, at pp2 (the MTP layer and a copy of the word
embedding on the last stage) and at tp2 x gtp2/a16 (its five GTP weights sharded, fc1's 200
rows padded to 224), each from the same initial weights; and the pp2 run resumed from
iteration 2 at tp2 x gtp2/a16 with the distributed optimizer.

Every layout gives tp1's ``lm loss``, ``grad-norm`` and ``mtp_1 loss`` at every iteration (up
to the order of fp32 reductions, tests/helpers/tolerance.py); the resumed run gives the pp2
run's over iterations 3..5.
"""

from __future__ import annotations

import pytest

from resume_checks import assert_same_step, by_iteration, resumed_rows
from tolerance import LLAMA_TINY, assert_fp32_close

pytestmark = pytest.mark.e2e

MTP = ["model=llama_tiny", "model.mtp_num_layers=1", "train.train_iters=5",
       "checkpoint.save_interval=2", "train.eval_iters=0"]
GTP2 = ["parallelism=tp2dp2", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16"]
LAYOUTS = {"tp1": ["parallelism=tp1", "parallelism.nproc_per_node=4"],
           "pp2": ["parallelism=pp2dp2"], "tp2gtp2": GTP2}
RESUMED_AT = 2
# llama_tiny's parameters with one MTP layer (the terms of a reduction, tolerance.py): its
# 160,488 plus the MTP layer's 67,752 (enorm, hnorm and final norm 3 x 72, eh_proj 72 x 144 and
# a decoder layer's 57,168).
PARAMETERS = LLAMA_TINY + 67_752


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    train_jobs([(root / name, [*MTP, *layout]) for name, layout in LAYOUTS.items()]
               + [(root / "resumed", [*MTP, *GTP2, "optim.use_distributed_optimizer=true",
                                      f"checkpoint.load={root / 'pp2'}/checkpoints",
                                      f"checkpoint.load_iteration={RESUMED_AT}"])])
    return root


def _assert_same(got: dict, want: dict, steps: int) -> None:
    assert_same_step(got, want, steps, terms=PARAMETERS)
    assert_fp32_close(got["mtp_1 loss"], want["mtp_1 loss"], steps, PARAMETERS,
                      what=("mtp_1 loss", got["iteration"]))


@pytest.mark.parametrize("layout", ["pp2", "tp2gtp2"])
def test_every_layout_trains_the_mtp_model_as_tp1_does(runs, layout):
    want, _ = by_iteration(runs / "tp1")
    got, _ = by_iteration(runs / layout)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for it in got:
        _assert_same(got[it], want[it], it)
    assert want[5]["lm loss"] < want[1]["lm loss"] and want[5]["mtp_1 loss"] < want[1]["mtp_1 loss"]


def test_pp2_mtp_run_resumes_at_tp2_gtp2_with_the_distributed_optimizer(runs):
    want, _ = by_iteration(runs / "pp2")
    got = resumed_rows(runs / "resumed", RESUMED_AT)
    for it in (3, 4, 5):
        _assert_same(got[it], want[it], it - RESUMED_AT)


def test_export_leaves_the_mtp_layer_out_and_says_so(runs, capsys):
    """transformers' Llama has no place for MTP layers: the export writes the next-token model
    (every weight of LlamaForCausalLM, nothing else) and a note naming what it left out."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from ckpt import cli

    assert cli.main(["export", str(runs / "pp2" / "checkpoints"), str(runs / "hf")]) == 0
    assert "note: 10 weights not exported, multi-token prediction layers" in capsys.readouterr().out
    meta = json.loads((runs / "hf" / "gtp_recipes_export.json").read_text())
    left = meta["not_exported"]["weights"]
    assert len(left) == 10 and all(k.startswith("mtp.layers.0.") for k in left)
    exported = load_file(runs / "hf" / "model.safetensors")
    with torch.device("meta"):
        want = LlamaForCausalLM(LlamaConfig.from_pretrained(runs / "hf")).state_dict()
    assert sorted(exported) == sorted(want)
