"""recipes/data/: byte tokenizer, corpus preparation, megatron datasets, Megatron-style sampling.

Single process, no torch.distributed. Goldens come from the standard library (pydoc_data.topics) and
from the test's own input files, never from recipes.data.
"""

from __future__ import annotations

import json
import os
import re

import numpy
import pytest
import torch
from omegaconf import OmegaConf
from pydoc_data.topics import topics

from recipes import data as D
from recipes.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    GTPConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    ParallelismConfig,
    PrecisionConfig,
    TrainConfig,
)


def make_cfg(cache_dir, train_iters=8, seq_length=64, **data):
    """A full run config outside Hydra (``cache_dir`` and the output paths given explicitly)."""
    data.setdefault("cache_dir", str(cache_dir))
    return OmegaConf.structured(
        Config(
            model=ModelConfig(seq_length=seq_length),
            parallelism=ParallelismConfig(),
            gtp=GTPConfig(),
            precision=PrecisionConfig(),
            data=DataConfig(**data),
            optim=OptimConfig(),
            checkpoint=CheckpointConfig(save=None),
            logger=LoggerConfig(wandb=False),
            train=TrainConfig(train_iters=train_iters),
            output_dir=str(cache_dir),
        )
    )


def read_documents(prefix):
    """All documents of a Megatron prefix as lists of ids (through megatron's reader)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    docs = [numpy.array(ds[i]).tolist() for i in range(len(ds))]
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))  # one sequence per document
    del ds
    return docs


@pytest.fixture(scope="module")
def pydoc_cache(tmp_path_factory):
    """One pydoc cache shared by the iterator tests (built once, then hit)."""
    return tmp_path_factory.mktemp("pydoc_cache")


# ---------------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trips_pydoc_text():
    tok = D.ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.pad not in range(tok.vocab_size)  # never a data id, never eod
    assert isinstance(tok.unique_identifiers, dict)
    assert any(not text.isascii() for text in topics.values())  # real multi-byte UTF-8 covered
    for name, text in topics.items():
        ids = tok.tokenize(text)
        assert ids == list(text.encode("utf-8")), name
        assert tok.detokenize(ids) == text, name
        assert tok.detokenize(ids + [tok.eod]) == text  # eod is not text
    with pytest.raises(ValueError, match="300"):
        tok.detokenize([65, 300])


# ---------------------------------------------------------------------------------- corpora


def test_pydoc_corpus_builds_caches_and_decodes_to_the_stdlib_text(tmp_path, monkeypatch):
    data_cfg = make_cfg(tmp_path).data
    (prefix,) = D.prepare_data(data_cfg, seq_length=64)
    assert prefix.startswith(str(tmp_path))
    files = [prefix + ".bin", prefix + ".idx"]
    mtimes = [os.stat(f).st_mtime_ns for f in files]

    import megatron.core.datasets.indexed_dataset as indexed_dataset

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(indexed_dataset, "IndexedDatasetBuilder", no_rebuild)
    assert D.prepare_data(data_cfg, seq_length=64) == [prefix]
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes  # cache hit: not rebuilt
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temp dir left behind

    docs = read_documents(prefix)
    names = sorted(topics)  # one document per topic, in name order
    assert len(docs) == len(names)
    for name in ("assert", "for", "lambda", "with", names[0], names[-1]):
        doc = docs[names.index(name)]
        assert doc[-1] == 256  # eod closes every document
        assert bytes(doc[:-1]) == topics[name].encode("utf-8")
        assert bytes(doc[:-1]).decode("utf-8") == topics[name]
    assert all(doc[-1] == 256 and 256 not in doc[:-1] for doc in docs)


def test_text_and_jsonl_documents_round_trip(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    txt_docs = ["First file.\n\nA second paragraph stays in the same document.\n", "Ünïcödé ✓ 日本語"]
    jsonl_docs = ["line one", "multi\nline\n\nwith blank", "emoji 🎉 and \"quotes\""]
    paths = []
    for i, text in enumerate(txt_docs):
        p = src / f"doc{i}.txt"
        p.write_bytes(text.encode("utf-8"))
        paths.append(str(p))
    p = src / "docs.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(jsonl_docs)]
    lines.insert(1, "")  # a blank line is skipped
    lines.append(json.dumps({"text": ""}))  # an empty document is skipped
    p.write_text("\n".join(lines) + "\n")
    paths.append(str(p))

    cache = tmp_path / "cache"
    data_cfg = make_cfg(cache, source="text", paths=paths).data
    capsys.readouterr()
    (prefix,) = D.prepare_data(data_cfg, seq_length=16)
    # One line with the counts and the seconds it took; none on a cache hit below.
    assert re.fullmatch(rf"> tokenized the text corpus into {prefix}: 5 documents, \d+ tokens in "
                        r"\d+\.\d s\n", capsys.readouterr().out)
    tok = D.ByteTokenizer()
    docs = read_documents(prefix)
    assert [tok.detokenize(d) for d in docs] == txt_docs + jsonl_docs
    assert all(d[-1] == tok.eod for d in docs)

    # Same inputs: same cache; a changed input file: a new corpus.
    assert D.prepare_data(data_cfg, seq_length=16) == [prefix]
    assert capsys.readouterr().out == ""
    (src / "doc0.txt").write_text("changed, and longer than before")
    (prefix2,) = D.prepare_data(data_cfg, seq_length=16)
    assert prefix2 != prefix
    assert tok.detokenize(read_documents(prefix2)[0]) == "changed, and longer than before"

    # A different jsonl field.
    q = src / "other.jsonl"
    q.write_text(json.dumps({"body": "from body"}) + "\n" + json.dumps({"body": "second"}) + "\n")
    (prefix3,) = D.prepare_data(make_cfg(cache, source="text", paths=[str(q)], jsonl_key="body").data, 4)
    assert [tok.detokenize(d) for d in read_documents(prefix3)] == ["from body", "second"]


def test_a_failed_conversion_leaves_no_cache(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text " * 20)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "no text"}) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"bad.jsonl:2.*jsonl_key='text'"):
        D.prepare_data(make_cfg(cache, source="text", paths=[str(good), str(bad)]).data, 64)
    assert os.listdir(cache) == []


# ---------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_sampler_global_batch_is_a_fixed_range(dp_size):
    gbs, mbs = 16, 2
    for step in range(3):
        by_rank = []
        for rank in range(dp_size):
            s = D.PretrainingSampler(10_000, step * gbs, mbs, gbs, rank, dp_size)
            assert s.num_microbatches == gbs // (mbs * dp_size)
            micro = list(s)[: s.num_microbatches]
            assert all(len(m) == mbs for m in micro)
            by_rank += [i for m in micro for i in m]
        assert by_rank == list(range(step * gbs, (step + 1) * gbs))


def test_sampler_stops_before_a_partial_global_batch():
    s = D.PretrainingSampler(40, 0, 2, 16, 0, 1)
    assert len(list(s)) == len(s) == 2 * 8  # 2 full global batches of 16 in 40 samples


def take_step(iterator):
    """The micro-batches of one iteration, concatenated along the batch dimension."""
    batches = [next(iterator) for _ in range(iterator.num_microbatches)]
    return {k: torch.cat([b[k] for b in batches]) for k in D.BATCH_KEYS}


def test_train_iterator_samples_are_independent_of_dp_size_and_resume_exactly(pydoc_cache):
    cfg = make_cfg(pydoc_cache, micro_batch_size=2, global_batch_size=16)
    mbs, seq = 2, cfg.model.seq_length

    reference = D.build_train_iterator(cfg, consumed_samples=0, dp_rank=0, dp_size=1)
    steps = [take_step(reference) for _ in range(3)]
    batch = next(D.build_train_iterator(cfg, 0, 0, 1))
    assert set(batch) == set(D.BATCH_KEYS)
    for key in ("tokens", "labels", "position_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (mbs, seq)
    assert batch["loss_mask"].dtype == torch.float32 and batch["loss_mask"].shape == (mbs, seq)
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])  # next-token labels
    assert torch.equal(batch["position_ids"][0], torch.arange(seq))
    assert bool((batch["loss_mask"] == 1).all())  # no padding in pretraining samples
    assert int(batch["tokens"].max()) < 257

    # Step 1 read by 2 and 4 ranks: concatenated by rank, the same tensors as at dp 1.
    for dp_size in (2, 4):
        parts = []
        for rank in range(dp_size):
            it = D.build_train_iterator(cfg, consumed_samples=16, dp_rank=rank, dp_size=dp_size)
            assert it.num_microbatches == 16 // (mbs * dp_size)
            parts.append(take_step(it))
        for key in D.BATCH_KEYS:
            assert torch.equal(torch.cat([p[key] for p in parts]), steps[1][key]), (dp_size, key)

    # Resume at dp 2 from consumed_samples=32: exactly the uninterrupted dp-1 run's 3rd step.
    resumed = [take_step(D.build_train_iterator(cfg, 32, rank, 2)) for rank in range(2)]
    for key in D.BATCH_KEYS:
        assert torch.equal(torch.cat([r[key] for r in resumed]), steps[2][key]), key
    assert not torch.equal(steps[1]["tokens"], steps[2]["tokens"])


def test_indexed_source_reads_a_prepared_prefix_like_the_original(pydoc_cache):
    (prefix,) = D.prepare_data(make_cfg(pydoc_cache).data, 64)
    cfg = make_cfg(pydoc_cache, source="indexed", tokenizer="external", paths=[prefix],
                   vocab_size=257, eod_id=256)
    tok = D.build_tokenizer(cfg.data)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    a = take_step(D.build_train_iterator(cfg, 0, 0, 1))
    b = take_step(D.build_train_iterator(make_cfg(pydoc_cache), 0, 0, 1))
    assert torch.equal(a["tokens"], b["tokens"])


def test_mock_source_yields_batches_without_files(tmp_path):
    cfg = make_cfg(tmp_path, source="mock", micro_batch_size=4, global_batch_size=8)
    assert D.prepare_data(cfg.data, 64) == []
    it = D.build_train_iterator(cfg, 0, 1, 2)
    batch = next(it)
    assert batch["tokens"].shape == (4, 64) and batch["tokens"].dtype == torch.int64
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("pydoc", "text"))]


# ---------------------------------------------------------------------------------- errors


def test_batch_sizes_not_divisible_name_the_numbers(tmp_path):
    cfg = make_cfg(tmp_path, source="mock", micro_batch_size=2, global_batch_size=16)
    with pytest.raises(ValueError, match=r"global_batch_size=16.*micro_batch_size=2.*dp_size=3"):
        D.build_train_iterator(cfg, 0, 0, 3)
    with pytest.raises(ValueError, match=r"consumed_samples=20"):
        D.build_train_iterator(cfg, 20, 0, 2)
    with pytest.raises(ValueError, match=r"dp_rank=2"):
        D.build_train_iterator(cfg, 0, 2, 2)


def test_missing_prefix_file_is_named(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    (tmp_path / "corpus_text_document.bin").write_bytes(b"")
    cfg = make_cfg(tmp_path, source="indexed", paths=[str(prefix)], vocab_size=100, eod_id=0)
    with pytest.raises(FileNotFoundError, match=r"corpus_text_document\.idx"):
        D.prepare_data(cfg.data, 64)
    with pytest.raises(FileNotFoundError, match=r"corpus_text_document\.idx"):
        D.build_datasets(cfg, D.build_tokenizer(cfg.data), 16)


def test_unknown_source_is_rejected(tmp_path):
    cfg = make_cfg(tmp_path, source="wikipedia")
    with pytest.raises(ValueError, match=r"data.source='wikipedia'.*'pydoc'.*'mock'"):
        D.prepare_data(cfg.data, 64)
    with pytest.raises(ValueError, match=r"data.source='wikipedia'"):
        D.build_train_iterator(cfg, 0, 0, 1)


@pytest.mark.parametrize("missing", ["vocab_size", "eod_id"])
def test_indexed_needs_vocab_size_and_eod_id(tmp_path, missing):
    values = {"vocab_size": 50_000, "eod_id": 0}
    values[missing] = None
    cfg = make_cfg(tmp_path, source="indexed", paths=[str(tmp_path / "x")], **values)
    with pytest.raises(ValueError, match=rf"data\.{missing} is null"):
        D.prepare_data(cfg.data, 64)
    with pytest.raises(ValueError, match=rf"data\.{missing} is null"):
        D.build_tokenizer(cfg.data)


def test_bad_text_inputs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"data.paths is empty"):
        D.prepare_data(make_cfg(tmp_path, source="text").data, 64)
    with pytest.raises(ValueError, match=r"data.paths is empty"):
        D.prepare_data(make_cfg(tmp_path, source="indexed", vocab_size=9, eod_id=0).data, 64)
    csv = tmp_path / "a.csv"
    csv.write_text("x,y\n")
    with pytest.raises(ValueError, match=r"unknown suffix '.csv'.*'.txt', '.jsonl'"):
        D.prepare_data(make_cfg(tmp_path, source="text", paths=[str(csv)]).data, 64)
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        D.prepare_data(make_cfg(tmp_path, source="text", paths=[str(tmp_path / "nope.txt")]).data, 64)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"corpus is empty"):
        D.prepare_data(make_cfg(tmp_path, source="text", paths=[str(empty)]).data, 64)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match=r"too few for one sample of model.seq_length=64"):
        D.prepare_data(make_cfg(tmp_path, source="text", paths=[str(short)]).data, 64)
    with pytest.raises(ValueError, match=r"data.tokenizer='external'"):
        D.prepare_data(make_cfg(tmp_path, tokenizer="external").data, 64)
    with pytest.raises(ValueError, match=r"data.split='0,1'"):
        D.build_datasets(make_cfg(tmp_path, split="0,1"), D.ByteTokenizer(), 16)
