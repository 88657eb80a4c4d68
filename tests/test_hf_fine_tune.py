"""A fine-tune from a Hugging Face model, per model family, as a user runs one: ``train.py
checkpoint.pretrained=HF_DIR`` at a layout that splits the model with GTP, lr > 0, then
``checkpoint.load=DIR`` alone at tp1 (the model and tokenizer come from the checkpoint), then
``python -m gtp export``.

- dense (``recipes/families/gpt``): a Qwen3 (q/k norms, head_dim 16 apart from hidden / heads;
  4 layers; QKV 160 and SwiGLU fc1 200 rows, which gtp2/a16 pads) at tp2 x gtp2/a16;
- MoE (``recipes/families/moe``): a Qwen3-MoE (4 layers, 4 experts, top 2) at ep2 x expert
  gtp2/a16 (expert fc1 48 rows, fc2 32: both padded).

Both come from ``transformers`` (``save_pretrained``) with a tokenizer that ``transformers``
saved beside them (a byte-level BPE of the model's 257 tokens), so the fine-tune reads its
data through the source's tokenizer. Checked: the resumed run's iterations 3..5 equal the GTP
run's within ``tolerance.fp32_rtol`` (another layout: fp32 rounding only, growing with the
steps since the resume), the export of the resumed run is the source's architecture
(``config.json``) with its tokenizer files byte for byte, and ``AutoTokenizer`` of the export
encodes text as the source's does. All four jobs share one 4-process world.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ckpt import cli
from hf_checks import byte_bpe
from resume_checks import assert_same_step, by_iteration

pytestmark = pytest.mark.multiprocess

VOCAB = 257  # the byte-level BPE below: <|endoftext|> and the 256 byte symbols
SEQ = 64
COMMON = ("parallelism=tp1", "parallelism.nproc_per_node=4", "train.train_iters=5",
          "checkpoint.save_interval=2", "train.eval_iters=0", "optim.lr=3e-3",
          "data.micro_batch_size=1", "data.global_batch_size=4")  # small steps: CPU time
GTP_LAYOUT = {
    "qwen3": ("parallelism.tensor_model_parallel_size=2", "gtp.gtp_remat_size=2",
              "gtp.pad_for_alignment=16"),
    "qwen3_moe": ("parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
                  "gtp.pad_for_alignment=16"),
}
RESUMED_AT = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXT = "def fine_tune(model):\n    return model  # é"


def _tokenizer():
    """A ``PreTrainedTokenizerFast`` of the byte-level BPE, end of text first."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe(VOCAB), eos_token="<|endoftext|>")


def _save_models(root) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    common = dict(vocab_size=VOCAB, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    models = {
        "qwen3": Qwen3ForCausalLM(Qwen3Config(
            **common, hidden_size=72, intermediate_size=100, num_attention_heads=6)),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
            num_attention_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    }
    tokenizer = _tokenizer()
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    """{family: (GTP run dir, resumed run dir)}: each source fine-tuned for 5 iterations at its
    GTP layout (saves at 2, 4, 5), and resumed from iteration 2 at tp1 (dp4) by
    ``checkpoint.load`` with no model field given."""
    root = tmp_path_factory.mktemp("fine_tune")
    _save_models(root)
    jobs, dirs = [], {}
    for name, layout in GTP_LAYOUT.items():
        gtp_run, resumed = root / f"{name}_gtp", root / f"{name}_tp1"
        jobs += [(gtp_run, [*COMMON, f"checkpoint.pretrained={root / name}", *layout]),
                 (resumed, [*COMMON, f"checkpoint.load={gtp_run}/checkpoints",
                            f"checkpoint.load_iteration={RESUMED_AT}"])]
        dirs[name] = (root / name, gtp_run, resumed)
    done = train_jobs(jobs)
    for job in done[1::2]:
        assert "(not given here): model." in job.stdout, job.stdout[-3000:]
    return dirs, {job.out_dir: job.stdout for job in done}


@pytest.mark.parametrize("name", GTP_LAYOUT)
def test_a_fine_tune_at_a_gtp_layout_resumes_at_tp1(runs, name):
    dirs, stdout = runs
    _, gtp_run, resumed = dirs[name]
    # the resumed run's parameter count (tp1: rank 0 holds every weight) sizes the tolerance
    terms = int(re.search(r"parameters on rank 0: (\d+)", stdout[resumed]).group(1))
    want, _ = by_iteration(gtp_run)
    got, events = by_iteration(resumed)
    assert events[0]["event"] == "resume" and events[0]["iteration"] == RESUMED_AT
    assert sorted(want) == [1, 2, 3, 4, 5] and sorted(got) == [3, 4, 5]
    for it in (3, 4, 5):
        assert_same_step(got[it], want[it], steps=it - RESUMED_AT, terms=terms)
    assert want[5]["lm loss"] < want[1]["lm loss"]  # it learned: lr > 0 moved the weights


@pytest.mark.parametrize("name", GTP_LAYOUT)
def test_the_export_of_the_resumed_fine_tune_is_the_source_architecture_and_tokenizer(
        runs, tmp_path, name):
    from transformers import AutoConfig, AutoTokenizer

    dirs, _ = runs
    src, _, resumed = dirs[name]
    out = tmp_path / "exported"
    assert cli.main(["export", str(resumed / "checkpoints"), str(out)]) == 0
    drop = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")
    got, want = (
        {k: v for k, v in AutoConfig.from_pretrained(d, trust_remote_code=False).to_dict().items()
         if k not in drop}
        for d in (out, src))
    assert got == want
    saved = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(saved)
    for f in saved:
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    back, source = (AutoTokenizer.from_pretrained(out, trust_remote_code=False),
                    AutoTokenizer.from_pretrained(src, trust_remote_code=False))
    assert back(TEXT).input_ids == source(TEXT).input_ids
    assert back.decode(back(TEXT).input_ids) == TEXT
    assert back.eos_token_id == source.eos_token_id == 0
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
