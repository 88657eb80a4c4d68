"""End to end (tests/helpers/inworld.py): data=chat training on tests/data/chat.jsonl with the
test ChatML tokenizer (tests/helpers/chat_data.py), packed, with the loss per token.

* ``g2``: llama_tiny at tp2 x g2/a16, saved at iteration 2; ``g2_resumed``: resumed there at the
  same layout (bit for bit); ``dp2_resumed``: resumed at tp1 x dp2 with one sample a micro-batch
  instead of two, iterations 3..5 within the derived bound of ``g2``'s.
* ``packed_*`` / ``unpacked_*``: one iteration over every conversation once, packed into 16
  samples or one a sample, for tiny (learned positions: ``position_ids`` restart per
  conversation) and llama_tiny (RoPE: megatron 0.19.2 rotates by the position in the sample,
  and rotary attention depends only on the distance between two tokens); the first step's loss
  (the mean over every assistant token) agrees within the derived bound.
"""

from __future__ import annotations

import pytest
from chat_data import FIXTURE, write_chat_tokenizer
from compose import make_cfg
from resume_checks import assert_bit_for_bit, assert_same_step, by_iteration, resumed_rows
from tolerance import assert_fp32_close

from recipes.data import build_tokenizer, chat
from recipes.families import parameter_shapes
from recipes.model.shapes import count, padded_vocab_size

pytestmark = pytest.mark.e2e

RESUMED_AT = 2
PACKED_SAMPLES, CONVERSATIONS = 16, 38  # at model.seq_length=128


def chat_overrides(tok_dir):
    return ["data=chat", f"data.tokenizer={tok_dir}", f"data.paths=[{FIXTURE}]",
            "data.split=100/0/0", "train.eval_iters=0", "model.seq_length=128",
            "train.calculate_per_token_loss=true"]


def terms(model: str, tok_dir) -> int:
    """Parameters of ``model`` with the test tokenizer's padded vocabulary."""
    cfg = make_cfg(f"model={model}", f"data.tokenizer={tok_dir}")
    return count(parameter_shapes(cfg.model, padded_vocab_size(
        400, cfg.model.make_vocab_size_divisible_by, 1)))


@pytest.fixture(scope="module")
def runs(train_jobs, data_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok_dir = write_chat_tokenizer(root / "tokenizer")
    # Tokenized here, once (transformers' import is most of it): the jobs read the cache.
    for packing in ("true", "false"):
        cfg = make_cfg(*chat_overrides(tok_dir), f"data.chat_packing={packing}",
                       f"data.cache_dir={data_cache}")
        chat.prepare_chat(cfg.data, 128, pad_id=build_tokenizer(cfg.data).eod)
    common = [*chat_overrides(tok_dir), "data.chat_packing=true", "model=llama_tiny",
              "train.train_iters=5", "data.global_batch_size=4"]
    g2 = ["parallelism=tp2", "parallelism.nproc_per_node=4", "gtp=tp2_align16",
          "data.micro_batch_size=2"]
    load = [f"checkpoint.load={root / 'g2'}/checkpoints", f"checkpoint.load_iteration={RESUMED_AT}",
            "checkpoint.save=null"]
    jobs = {
        "g2": [*common, *g2, "checkpoint.save_interval=2"],
        "g2_resumed": [*common, *g2, *load],
        "dp2_resumed": [*common, "parallelism=dp2", "data.micro_batch_size=1", *load],
    }
    one_pass = [*chat_overrides(tok_dir), "parallelism=dp2", "train.train_iters=1",
                "checkpoint=none"]
    for model in ("tiny", "llama_tiny"):
        for name, samples, packing in (("packed", PACKED_SAMPLES, "true"),
                                       ("unpacked", CONVERSATIONS, "false")):
            jobs[f"{name}_{model}"] = [*one_pass, f"model={model}", f"data.chat_packing={packing}",
                                       f"data.global_batch_size={samples}",
                                       f"data.micro_batch_size={samples // 2}"]
    done = train_jobs([(root / name, overrides) for name, overrides in jobs.items()])
    return {"root": root, "tok_dir": tok_dir,
            "consoles": dict(zip(jobs, (job.stdout for job in done)))}


def test_chat_resumes_exactly_at_the_same_layout(runs):
    root = runs["root"]
    want, _ = by_iteration(root / "g2")
    got = resumed_rows(root / "g2_resumed", RESUMED_AT)
    assert_bit_for_bit(got, want, (3, 4, 5), got_dir=root / "g2_resumed", want_dir=root / "g2")


def test_chat_saved_at_tp2_g2_resumes_at_tp1_dp2_and_another_micro_batch(runs):
    root = runs["root"]
    want, _ = by_iteration(root / "g2")
    got = resumed_rows(root / "dp2_resumed", RESUMED_AT)
    for it in got:  # the same samples: only the layout's rounding apart
        assert_same_step(got[it], want[it], it - RESUMED_AT, terms=terms("llama_tiny",
                                                                          runs["tok_dir"]))


@pytest.mark.parametrize("model", ["tiny", "llama_tiny"])
def test_packed_loss_equals_the_unpacked_loss_per_token(runs, model):
    root = runs["root"]
    packed = by_iteration(root / f"packed_{model}")[0][1]
    unpacked = by_iteration(root / f"unpacked_{model}")[0][1]
    assert packed["consumed-samples"] == PACKED_SAMPLES
    assert unpacked["consumed-samples"] == CONVERSATIONS
    assert_fp32_close(packed["lm loss"], unpacked["lm loss"], 1, terms(model, runs["tok_dir"]),
                      what=(model,))
