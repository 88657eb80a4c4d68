"""data.tokenizer=<Hugging Face tokenizer.json>: a BPE tokenizer trained here on the embedded
corpus (CPython's pydoc topics) with the ``tokenizers`` library, used for data, training, saving
and resuming."""

from __future__ import annotations

import json
import math

import numpy
import pytest
from compose import make_cfg
from resume_checks import assert_bit_for_bit

from recipes.data import HFTokenizer, build_tokenizer, prepare_data
from recipes.metrics.logger import read_metrics

VOCAB = 400
EOD = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE of VOCAB tokens (EOD first) trained on the pydoc topics."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((topics[k] for k in sorted(topics)), trainer)
    out = tmp_path_factory.mktemp("bpe")
    tok.save(str(out / "tokenizer.json"))
    return out


def test_tokenizer_json_file_or_directory(bpe_dir):
    for path in (bpe_dir, bpe_dir / "tokenizer.json"):
        tok = build_tokenizer(make_cfg(f"data.tokenizer={path}").data)
        assert isinstance(tok, HFTokenizer)
        assert tok.vocab_size == VOCAB and tok.eod == 0  # the special token comes first
        text = "def f(x):\n    return x  # é"
        assert tok.detokenize(tok.tokenize(text)) == text
        assert len(tok.tokenize(text)) < len(text.encode())  # merges happened


def test_bad_tokenizer_paths_and_sizes(bpe_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer='/nonexistent'.*'byte'"):
        build_tokenizer(make_cfg("data.tokenizer=/nonexistent").data)
    with pytest.raises(ValueError, match=r"data.vocab_size=500 differs from the 400 tokens"):
        build_tokenizer(make_cfg(f"data.tokenizer={bpe_dir}", "data.vocab_size=500").data)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(make_cfg(f"data.tokenizer={tmp_path}").data)


def test_corpus_is_the_tokenizers_encoding(bpe_dir, tmp_path):
    """The pydoc corpus written through the BPE: each document is the library's encoding + eod."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    cfg = make_cfg(f"data.tokenizer={bpe_dir}", f"data.cache_dir={tmp_path}")
    (prefix,) = prepare_data(cfg.data, cfg.model.seq_length)
    assert "pydoc_hf-" in prefix
    ds = IndexedDataset(prefix)
    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    first = topics[sorted(topics)[0]]
    want = ref.encode(first, add_special_tokens=False).ids + [0]
    assert ds[0].tolist() == want and ds[0].dtype == numpy.uint16
    meta = json.loads((tmp_path / prefix.split("/")[-2] / "meta.json").read_text())
    assert meta["tokenizer"]["vocab_size"] == VOCAB and meta["tokenizer"]["sha256"]


@pytest.mark.e2e
def test_bpe_trains_saves_and_resumes(bpe_dir, train_jobs, tmp_path):
    common = ["train.train_iters=3", "optim.lr_warmup_iters=1", f"data.tokenizer={bpe_dir}"]
    a, b = tmp_path / "a", tmp_path / "b"
    train_jobs([(a, [*common, "checkpoint.save_interval=2"]),
                (b, [*common, f"checkpoint.load={a}/checkpoints", "checkpoint.load_iteration=2",
                     "checkpoint.save=null"])])
    ra = {r["iteration"]: r for r in read_metrics(a)[0]}
    rb = {r["iteration"]: r for r in read_metrics(b)[0]}
    assert sorted(ra) == [1, 2, 3] and sorted(rb) == [3]
    # At initialization the loss is about ln(400): the softmax spans the 400 real tokens only.
    assert abs(ra[1]["lm loss"] - math.log(VOCAB)) < 0.1, ra[1]["lm loss"]
    assert_bit_for_bit(rb, ra, (3,), got_dir=b, want_dir=a)  # the same layout and machine
    from megatron.core import dist_checkpointing

    common_state = dist_checkpointing.load_common_state_dict(str(a / "checkpoints" / "iter_0000002"))
    assert common_state["vocab_size"] == VOCAB
