"""The data pipeline of a GPT pretraining run, on megatron-core's own pieces.

* :class:`ByteTokenizer`: ids 0..255 are bytes (UTF-8 for text), 256 is ``<eod>``; 257 ids.
* :func:`prepare_data`: turns ``data.source`` into Megatron indexed-dataset prefixes (``.bin`` +
  ``.idx``, written with megatron's ``IndexedDatasetBuilder``), cached under ``data.cache_dir``.
* :func:`build_datasets`: megatron's ``GPTDataset`` (or ``MockGPTDataset``) train/valid/test splits
  through ``BlendedMegatronDatasetBuilder``.
* :func:`build_train_iterator`: micro-batches for one data-parallel rank, sampled like Megatron-LM's
  ``MegatronPretrainingSampler`` (see :class:`PretrainingSampler`), resumable from
  ``consumed_samples`` under any data-parallel size.

Corpus layout under ``cache_dir`` (the key in each name changes whenever the input changes, so a stale
cache is never read)::

    pydoc_byte-<key>/text_document.{bin,idx}   + meta.json   (source=pydoc)
    text_byte-<key>/text_document.{bin,idx}    + meta.json   (source=text)
    gpt_indices/<hash>-GPTDataset-train-*.npy                (megatron's sample/shuffle indices)

A corpus directory is built under a temporary name and renamed into place with ``os.replace``: two
processes racing, or a crash half-way, never leave a half-written corpus behind.

Distributed use: :func:`build_datasets` and :func:`build_train_iterator` are collective when
``torch.distributed`` is initialized: every rank of the default group must call them (global rank 0
builds the corpus and megatron's index caches first, the others then read them). ``cache_dir`` must
therefore be on a filesystem all ranks see (as Megatron-LM's ``--data-cache-path``). Without
``torch.distributed`` everything runs in the calling process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy
import torch

logger = logging.getLogger(__name__)

SOURCES = ("pydoc", "text", "indexed", "mock")
TOKENIZERS = ("byte", "external")
TEXT_SUFFIXES = (".txt", ".jsonl")
# Bump when the way a corpus is written changes: every cached corpus is then rebuilt.
CORPUS_FORMAT_VERSION = 1
# Megatron's "no pad token" id (megatron.core.datasets.megatron_dataset._PAD_TOKEN_ID,
# NullTokenizer's default pad_id): outside every vocabulary, so it never occurs in a corpus.
NO_PAD_ID = -1
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_PREFIX_NAME = "text_document"


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class _TokenizerBase:
    """What megatron's GPTDataset reads from a tokenizer: ``vocab_size``, ``eod``, ``pad`` and a
    ``unique_identifiers`` dict (part of its index-cache key)."""

    vocab_size: int
    eod: int
    pad: int = NO_PAD_ID

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad}

    @property
    def eos(self) -> int:
        """Alias of ``eod`` (some megatron code asks for ``eos``)."""
        return self.eod


class ByteTokenizer(_TokenizerBase):
    """Bytes as tokens: ids 0..255 are the bytes of the UTF-8 text, ``eod`` = 256.

    ``vocab_size`` = 257 (the model pads it to ``make_vocab_size_divisible_by``).

    ``pad`` = -1 (megatron's "no pad token", as its ``NullTokenizer``), not ``eod``: megatron's
    ``GPTDataset`` zeroes the loss where ``labels == pad`` and rewrites ``tokens == pad`` to 0, so a pad
    equal to ``eod`` would hide every document end from the model (megatron detects that collision,
    warns and disables pad masking). Pretraining samples are never padded (the last partial sample is
    dropped); megatron's padding-only sample (index ``None``) gets an all-zero loss mask. So pad is
    excluded from the loss and never collides with data.
    """

    vocab_size: int = 257
    eod: int = 256

    def tokenize(self, text: Union[str, bytes]) -> list[int]:
        """UTF-8 bytes of ``text`` (or the given bytes) as ids in [0, 255]; no ``eod`` is added."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: byte ids are decoded as UTF-8 (invalid sequences, e.g. a character
        cut at a sample boundary, become U+FFFD); ``eod`` and ``pad`` ids are dropped.

        Raises:
            ValueError: an id outside [0, 256] other than ``pad``.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i in (self.eod, self.pad):
                continue
            else:
                raise ValueError(f"id {i} is not a byte-tokenizer id: valid are 0..255 and eod=256")
        return out.decode("utf-8", errors="replace")

    def encode_bytes(self, data: bytes) -> numpy.ndarray:
        """``data`` as a uint16 id array (no ``eod``); the fast path used to write corpora."""
        return numpy.frombuffer(data, dtype=numpy.uint8).astype(numpy.uint16)


class ExternalTokenizer(_TokenizerBase):
    """Stand-in for the tokenizer that made ``source=indexed`` data: only what megatron's GPTDataset
    reads (``vocab_size``, ``eod``, ``pad`` = -1, ``unique_identifiers``). It cannot (de)tokenize."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        if vocab_size < 1 or not 0 <= eod < vocab_size:
            raise ValueError(
                f"data.eod_id={eod} must lie in [0, data.vocab_size={vocab_size})"
            )
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)

    def tokenize(self, text: str) -> list[int]:
        """Not available: raises NotImplementedError."""
        raise NotImplementedError("source=indexed data was tokenized outside gtp-recipes")

    def detokenize(self, ids: Iterable[int]) -> str:
        """Not available: raises NotImplementedError."""
        raise NotImplementedError("source=indexed data was tokenized outside gtp-recipes")


Tokenizer = Union[ByteTokenizer, ExternalTokenizer]


def build_tokenizer(data_cfg: Any) -> Tokenizer:
    """The tokenizer of ``data_cfg``: :class:`ByteTokenizer` for pydoc/text/mock, an
    :class:`ExternalTokenizer` from ``data.vocab_size`` / ``data.eod_id`` for indexed.

    Raises:
        ValueError: unknown ``data.source`` or ``data.tokenizer``; ``source=indexed`` with a null
            ``data.vocab_size`` or ``data.eod_id``; pydoc/text with ``tokenizer`` other than byte.
    """
    source = _check_source(data_cfg)
    if source == "indexed":
        vocab_size, eod_id = data_cfg.vocab_size, data_cfg.eod_id
        for name, value in (("vocab_size", vocab_size), ("eod_id", eod_id)):
            if value is None:
                raise ValueError(
                    f"data.{name} is null: source=indexed needs data.vocab_size and data.eod_id "
                    f"of the tokenizer that made {list(data_cfg.paths)} (for data made with the "
                    f"byte tokenizer: vocab_size=257, eod_id=256)"
                )
        return ExternalTokenizer(int(vocab_size), int(eod_id))
    if source in ("pydoc", "text") and data_cfg.tokenizer != "byte":
        raise ValueError(
            f"data.tokenizer={data_cfg.tokenizer!r} with data.source={source!r}: gtp-recipes "
            f"converts text with the byte tokenizer only (valid: 'byte'); tokenize with your own "
            f"tokenizer into Megatron .bin/.idx files and use data=indexed instead"
        )
    return ByteTokenizer()


def _check_source(data_cfg: Any) -> str:
    source = data_cfg.source
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r}: valid are {SOURCES}")
    if data_cfg.tokenizer not in TOKENIZERS:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r}: valid are {TOKENIZERS}")
    return source


# --------------------------------------------------------------------------------------------
# Corpus preparation
# --------------------------------------------------------------------------------------------


def prepare_data(data_cfg: Any, seq_length: int) -> list[str]:
    """Megatron indexed-dataset prefixes (``<prefix>.bin`` / ``<prefix>.idx``) for ``data_cfg``.

    * ``pydoc``: CPython's ``pydoc_data.topics.topics``, one document per topic (sorted by name),
      each followed by ``eod``; built once into ``<cache_dir>/pydoc_byte-<key>/text_document``.
    * ``text``: ``data.paths`` in the given order; a ``.txt`` file is one document (its exact bytes),
      a ``.jsonl`` line is one document (the string under ``data.jsonl_key``; blank lines skipped).
      Empty documents are skipped. Built once into ``<cache_dir>/text_byte-<key>/text_document``,
      ``key`` hashing the absolute paths, mtimes, sizes and ``jsonl_key``.
    * ``indexed``: ``data.paths`` as given (absolute), after checking the files exist.
    * ``mock``: ``[]`` (megatron's MockGPTDataset reads no files).

    Corpora are written with uint16 ids and built only when missing, atomically. Safe to call from
    several processes at once (each may build; one rename wins), but :func:`build_datasets` lets
    rank 0 build first.

    Args:
        data_cfg: a ``DataConfig`` (dataclass or OmegaConf node, ``cache_dir`` resolved).
        seq_length: model sequence length; the corpus must hold at least ``seq_length + 1`` tokens.

    Returns:
        list[str]: absolute prefixes (one for pydoc/text, ``len(paths)`` for indexed, none for mock).

    Raises:
        ValueError: unknown source / tokenizer / file suffix, empty ``paths`` for text/indexed,
            a bad ``.jsonl`` line, null vocab_size/eod_id for indexed, a corpus with no documents or
            fewer than ``seq_length + 1`` tokens.
        FileNotFoundError: a text file, or an indexed prefix's ``.bin`` / ``.idx``, is missing.
    """
    source = _check_source(data_cfg)
    tokenizer = build_tokenizer(data_cfg)
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    if source == "mock":
        return []
    if source == "indexed":
        prefixes = _check_indexed_paths(data_cfg)
        for prefix in prefixes:
            _check_min_tokens(prefix, seq_length, f"indexed data {prefix}")
        return prefixes

    cache_dir = _cache_dir(data_cfg)
    if source == "pydoc":
        from pydoc_data.topics import topics

        names = sorted(topics)
        key = _hash_key(
            [CORPUS_FORMAT_VERSION, tokenizer.unique_identifiers]
            + [[name, topics[name]] for name in names]
        )
        out_dir = os.path.join(cache_dir, f"pydoc_byte-{key}")
        inputs = {"pydoc_data.topics": f"{len(names)} topics"}

        def documents() -> Iterator[bytes]:
            for name in names:
                yield topics[name].encode("utf-8")

    else:  # text
        files = _check_text_paths(data_cfg)
        stats = [os.stat(p) for p in files]
        key = _hash_key(
            [CORPUS_FORMAT_VERSION, tokenizer.unique_identifiers, data_cfg.jsonl_key]
            + [[p, s.st_mtime_ns, s.st_size] for p, s in zip(files, stats)]
        )
        out_dir = os.path.join(cache_dir, f"text_byte-{key}")
        inputs = {p: {"mtime_ns": s.st_mtime_ns, "size": s.st_size} for p, s in zip(files, stats)}
        jsonl_key = data_cfg.jsonl_key

        def documents() -> Iterator[bytes]:
            for path in files:
                yield from _read_documents(path, jsonl_key)

    prefix = _build_corpus(out_dir, documents, tokenizer, source, inputs)
    _check_min_tokens(prefix, seq_length, f"the {source} corpus")
    return [prefix]


def _cache_dir(data_cfg: Any) -> str:
    cache_dir = data_cfg.cache_dir
    if not cache_dir:
        raise ValueError(f"data.cache_dir={cache_dir!r}: set a writable directory")
    return os.path.abspath(os.path.expanduser(str(cache_dir)))


def _hash_key(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _check_paths_nonempty(data_cfg: Any) -> list[str]:
    paths = list(data_cfg.paths or [])
    if not paths:
        what = (
            "Megatron prefixes (without .bin/.idx)"
            if data_cfg.source == "indexed"
            else f"files with suffix in {TEXT_SUFFIXES}"
        )
        raise ValueError(f"data.paths is empty: data.source={data_cfg.source!r} needs {what}")
    return [os.path.abspath(os.path.expanduser(str(p))) for p in paths]


def check_data_paths(data_cfg: Any) -> None:
    """Cheap check that ``data.paths`` name existing files of the right kind for ``data.source``
    (run before launch, so a missing file fails before any model is built).

    Raises:
        ValueError, FileNotFoundError: naming the path and what is expected.
    """
    if data_cfg.source == "indexed":
        _check_indexed_paths(data_cfg)
    elif data_cfg.source == "text":
        _check_text_paths(data_cfg)


def _check_indexed_paths(data_cfg: Any) -> list[str]:
    prefixes = _check_paths_nonempty(data_cfg)
    for i, prefix in enumerate(prefixes):
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                hint = (
                    " (data.paths are prefixes: drop the .bin/.idx suffix)"
                    if prefix.endswith((".bin", ".idx"))
                    else ""
                )
                raise FileNotFoundError(
                    f"data.paths[{i}]={data_cfg.paths[i]!r}: missing {prefix + suffix}{hint}"
                )
    return prefixes


def _check_text_paths(data_cfg: Any) -> list[str]:
    files = _check_paths_nonempty(data_cfg)
    for i, path in enumerate(files):
        suffix = os.path.splitext(path)[1]
        if suffix not in TEXT_SUFFIXES:
            raise ValueError(
                f"data.paths[{i}]={data_cfg.paths[i]!r}: unknown suffix {suffix!r}; "
                f"valid are {TEXT_SUFFIXES} (for Megatron .bin/.idx use data=indexed)"
            )
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.paths[{i}]={data_cfg.paths[i]!r}: no such file {path}")
    return files


def _read_documents(path: str, jsonl_key: str) -> Iterator[bytes]:
    """The documents of one input file, as UTF-8 bytes."""
    if path.endswith(".txt"):
        with open(path, "rb") as f:
            yield f.read()
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({err})") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or jsonl_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{lineno}: no field data.jsonl_key={jsonl_key!r} (found {keys})"
                )
            text = record[jsonl_key]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {jsonl_key!r} is {type(text).__name__}, expected a string"
                )
            yield text.encode("utf-8")


def _corpus_ready(out_dir: str) -> bool:
    prefix = os.path.join(out_dir, _PREFIX_NAME)
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _build_corpus(
    out_dir: str,
    documents: Callable[[], Iterable[bytes]],
    tokenizer: ByteTokenizer,
    source: str,
    inputs: dict,
) -> str:
    """Write ``documents`` (each + eod) to ``<out_dir>/text_document`` unless already there."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(out_dir, _PREFIX_NAME)
    if _corpus_ready(out_dir):
        return prefix
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        tmp_prefix = os.path.join(tmp_dir, _PREFIX_NAME)
        builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=numpy.uint16)
        num_docs = num_tokens = skipped = 0
        eod = numpy.array([tokenizer.eod], dtype=numpy.uint16)
        try:
            for doc in documents():
                if not doc:
                    skipped += 1
                    continue
                ids = numpy.concatenate([tokenizer.encode_bytes(doc), eod])
                builder.add_document(ids, [ids.size])
                num_docs += 1
                num_tokens += ids.size
        finally:
            builder.finalize(tmp_prefix + ".idx")
        if num_docs == 0:
            raise ValueError(
                f"the {source} corpus is empty: no non-empty document in {sorted(inputs)}"
            )
        meta = {
            "format": CORPUS_FORMAT_VERSION,
            "source": source,
            "tokenizer": tokenizer.unique_identifiers,
            "documents": num_docs,
            "skipped_empty_documents": skipped,
            "tokens": num_tokens,
            "inputs": inputs,
        }
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        for name in os.listdir(tmp_dir):
            with open(os.path.join(tmp_dir, name), "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp_dir, 0o755)
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            # Another process renamed its complete copy into place first: use that one.
            if not _corpus_ready(out_dir):
                raise
        else:
            logger.info(
                "built %s corpus %s: %d documents, %d tokens", source, prefix, num_docs, num_tokens
            )
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return prefix


def _sequence_lengths(prefix: str) -> numpy.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Keep the dataset alive while copying: its __del__ closes the mmap the lengths point into.
    dataset = IndexedDataset(prefix)
    lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
    del dataset
    return lengths


def _check_min_tokens(prefix: str, seq_length: int, what: str) -> None:
    lengths = _sequence_lengths(prefix)
    if lengths.size == 0 or int(lengths.sum()) < seq_length + 1:
        raise ValueError(
            f"{what} holds {int(lengths.sum())} tokens in {lengths.size} documents: too few for "
            f"one sample of model.seq_length={seq_length} (needs {seq_length + 1})"
        )


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank0_first(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on global rank 0, then (after it succeeded) on the other ranks.

    A failure on rank 0 is broadcast, so the other ranks raise instead of waiting forever.
    """
    if not _dist_initialized():
        return fn()
    dist = torch.distributed
    rank = dist.get_rank()
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as err:  # re-raised below, after telling the other ranks
            error = err
    from gtp.collectives import collective_device

    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=collective_device())
    dist.broadcast(failed, src=0)
    if rank == 0:
        if error is not None:
            raise error
        return result
    if int(failed.item()):
        raise RuntimeError("global rank 0 failed to prepare the data; its error is in its log")
    return fn()


def _train_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the train split of ``prefix``, split by documents exactly as megatron does."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    lengths = _sequence_lengths(prefix)
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    if bounds is None:
        return 0
    beg = int(round(bounds[0] * float(lengths.size)))
    end = int(round(bounds[1] * float(lengths.size)))
    return int(lengths[beg:end].sum())


def _check_split(split: Any) -> str:
    split = str(split)
    parts = re.split(r"[,/]", split)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = None
    if (
        weights is None
        or not 1 <= len(weights) <= 3
        or any(w < 0 for w in weights)
        or weights[0] <= 0
    ):
        raise ValueError(
            f"data.split={split!r}: expected up to 3 comma-separated non-negative weights "
            f"train,valid,test with train > 0 (e.g. '98,2,0')"
        )
    return split


def build_datasets(
    cfg: Any, tokenizer: Tokenizer, train_samples: int
) -> tuple[Any, Optional[Any], Optional[Any]]:
    """Megatron's train/valid/test GPT datasets for ``cfg`` (collective under torch.distributed).

    Prepares the corpus (:func:`prepare_data`) and builds ``GPTDataset`` splits (``MockGPTDataset``
    for ``source=mock``) through ``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig(
    random_seed=cfg.train.seed, sequence_length=cfg.model.seq_length, split=cfg.data.split,
    path_to_cache=<cache_dir>/gpt_indices)``, no position-id/attention-mask reset, no eod loss
    masking, no attention mask. Sizes: ``[train_samples, None, None]`` (valid/test: one epoch of
    their split). Several indexed prefixes are blended in proportion to their sizes (megatron's
    unweighted blend, which does not repeat data).

    With torch.distributed initialized, every rank of the default group must call this: global
    rank 0 builds the corpus and index caches first, then the others load them (megatron's builder
    barriers); ``is_built_on_rank`` is true on every rank, so each rank gets the datasets.

    Each sample (``dataset[i]``) is a dict of 1-D tensors of length ``seq_length``: ``tokens``,
    ``labels``, ``position_ids`` (int64) and ``loss_mask`` (float32).

    Args:
        cfg: the whole run config (``data``, ``model.seq_length``, ``train.seed``).
        tokenizer: from :func:`build_tokenizer`.
        train_samples: number of train samples wanted (``train_iters * global_batch_size``).

    Returns:
        (train, valid, test): a split is ``None`` when its ``data.split`` weight is 0 (for
        ``source=mock`` megatron ignores ``data.split`` and splits its mock documents 1:1:1).

    Raises:
        ValueError: as :func:`prepare_data`; a malformed ``data.split``; ``train_samples`` < 1; a
            train split with fewer than ``seq_length + 1`` tokens; a blend of several prefixes
            holding fewer than ``train_samples`` train samples.
        FileNotFoundError: as :func:`prepare_data`.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    data_cfg = cfg.data
    seq_length = int(cfg.model.seq_length)
    source = _check_source(data_cfg)
    split = _check_split(data_cfg.split)
    if int(train_samples) < 1:
        raise ValueError(f"train_samples={train_samples} must be >= 1")
    # Cheap checks on every rank before any collective, so a bad config fails everywhere alike.
    if source == "indexed":
        build_tokenizer(data_cfg)
        _check_indexed_paths(data_cfg)
    elif source == "text":
        _check_text_paths(data_cfg)

    prefixes = _rank0_first(lambda: prepare_data(data_cfg, seq_length))
    for prefix in prefixes:
        tokens = _train_split_tokens(prefix, split)
        if tokens < seq_length + 1:
            raise ValueError(
                f"the train part of {prefix} under data.split={split!r} holds {tokens} tokens, "
                f"fewer than model.seq_length + 1 = {seq_length + 1}: give train a larger share "
                f"or add text"
            )

    config = GPTDatasetConfig(
        random_seed=int(cfg.train.seed),
        sequence_length=seq_length,
        blend=(prefixes, None) if prefixes else None,
        split=split,
        path_to_cache=os.path.join(_cache_dir(data_cfg), "gpt_indices"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if source == "mock" else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, [int(train_samples), None, None], lambda: True, config
    )
    train, valid, test = builder.build()
    if len(train) < train_samples:
        raise ValueError(
            f"the train data holds {len(train)} samples of {seq_length} tokens, fewer than the "
            f"{train_samples} asked for (megatron does not repeat an unweighted blend of "
            f"{len(prefixes)} prefixes): lower train.train_iters or add data"
        )
    return train, valid, test


# --------------------------------------------------------------------------------------------
# Sampling and the train iterator
# --------------------------------------------------------------------------------------------


class PretrainingSampler:
    """Index lists of micro-batches for one data-parallel rank, Megatron-LM style.

    Global batch ``b`` covers samples ``[b * gbs, (b + 1) * gbs)`` whatever ``dp_size`` is; rank
    ``r`` reads the contiguous slice ``[b * gbs + r * gbs / dp, b * gbs + (r + 1) * gbs / dp)`` of it
    as ``gbs / (mbs * dp)`` micro-batches of ``mbs`` consecutive indices. Iteration starts at global
    batch ``consumed_samples / gbs`` and stops before a global batch that would pass
    ``total_samples`` (megatron's drop_last). Like ``MegatronPretrainingSampler`` the samples of a
    global batch depend only on ``consumed_samples``; unlike it the micro-batches are not
    interleaved across ranks (rank r's micro-batch k is not ``b*gbs + (k*dp + r)*mbs``), so
    concatenating the ranks' micro-batches in rank order gives the global batch in order.

    Raises:
        ValueError: sizes < 1, ``dp_rank`` outside ``[0, dp_size)``, ``global_batch_size`` not a
            multiple of ``micro_batch_size * dp_size``, ``consumed_samples`` negative or not a
            multiple of ``global_batch_size``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("global_batch_size", global_batch_size),
            ("dp_size", dp_size),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        per_step = micro_batch_size * dp_size
        if global_batch_size % per_step != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
                f"{micro_batch_size} x dp_size={dp_size} (= {per_step})"
            )
        if consumed_samples < 0 or consumed_samples % global_batch_size != 0:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be a non-negative multiple of "
                f"global_batch_size={global_batch_size}"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.num_microbatches = global_batch_size // per_step

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        steps = max(0, self.total_samples // self.global_batch_size - self.start_step)
        return steps * self.num_microbatches

    @property
    def start_step(self) -> int:
        """Index of the first global batch (= iterations already done)."""
        return self.consumed_samples // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        gbs, mbs = self.global_batch_size, self.micro_batch_size
        per_rank = gbs // self.dp_size
        step = self.start_step
        while (step + 1) * gbs <= self.total_samples:
            base = step * gbs + self.dp_rank * per_rank
            for k in range(self.num_microbatches):
                start = base + k * mbs
                yield list(range(start, start + mbs))
            step += 1


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into a micro-batch: ``tokens``, ``labels``, ``position_ids`` int64
    ``[b, s]`` and ``loss_mask`` float32 ``[b, s]`` (other keys are dropped)."""
    return {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}


class MicroBatchIterator:
    """Iterator over the micro-batches of one data-parallel rank (dicts from :func:`collate`).

    Attributes: ``dataset``, ``sampler`` (:class:`PretrainingSampler`), ``num_microbatches`` (per
    iteration), ``tokenizer``. Ends (StopIteration) when the dataset holds no further full global
    batch.
    """

    def __init__(self, dataset: Any, sampler: PretrainingSampler, tokenizer: Any = None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.num_microbatches = sampler.num_microbatches
        self._indices = iter(sampler)

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        indices = next(self._indices)
        return collate([self.dataset[i] for i in indices])

    def __len__(self) -> int:
        return len(self.sampler)


def build_train_iterator(
    cfg: Any,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
    tokenizer: Optional[Tokenizer] = None,
    plan: Optional[Sequence[int]] = None,
) -> MicroBatchIterator:
    """Micro-batches of the train split for data-parallel rank ``dp_rank`` of ``dp_size``.

    Builds the tokenizer and datasets (:func:`build_datasets` with ``train_samples =
    train.train_iters * data.global_batch_size``; collective under torch.distributed) and samples
    them with :class:`PretrainingSampler` from ``consumed_samples``. Each iteration of training
    takes ``iterator.num_microbatches = global_batch_size / (micro_batch_size * dp_size)``
    micro-batches. Resuming from ``consumed_samples`` under any ``dp_size`` continues with exactly
    the same samples, as long as ``train.seed``, ``train.train_iters``, ``model.seq_length`` and
    the data are unchanged (they define megatron's shuffle, as in Megatron-LM).

    Each micro-batch is a dict: ``tokens``, ``labels``, ``position_ids``: int64
    ``[micro_batch_size, seq_length]``; ``loss_mask``: float32 ``[micro_batch_size, seq_length]``.

    ``tokenizer``: the one from :func:`build_tokenizer` when the caller already has it (else built
    here from ``cfg.data``).

    ``plan``: sample counts of consecutive data segments (default: one segment of
    ``train_iters * global_batch_size``). Segment ``k`` is a dataset of that many samples built
    with seed ``train.seed + k``; a run extended on resume appends a segment, so the samples
    planned before keep their order (a larger first segment would reshuffle them).

    Raises:
        ValueError: as :class:`PretrainingSampler` (with the numbers) and :func:`build_datasets`.
        FileNotFoundError: as :func:`prepare_data`.
    """
    data_cfg = cfg.data
    mbs, gbs = int(data_cfg.micro_batch_size), int(data_cfg.global_batch_size)
    plan = [int(cfg.train.train_iters) * gbs] if not plan else [int(n) for n in plan]
    train_samples = sum(plan)
    # Validate the layout before building anything (raises the same on every rank).
    PretrainingSampler(train_samples, consumed_samples, mbs, gbs, dp_rank, dp_size)
    if tokenizer is None:
        tokenizer = build_tokenizer(data_cfg)
    if len(plan) == 1:
        train, _, _ = build_datasets(cfg, tokenizer, train_samples)
    else:
        from omegaconf import OmegaConf

        parts = []
        for k, n in enumerate(plan):
            segment_cfg = OmegaConf.merge(cfg, {"train": {"seed": int(cfg.train.seed) + k}})
            part, _, _ = build_datasets(segment_cfg, tokenizer, n)
            parts.append(torch.utils.data.Subset(part, range(n)))
        train = torch.utils.data.ConcatDataset(parts)
    sampler = PretrainingSampler(len(train), consumed_samples, mbs, gbs, dp_rank, dp_size)
    return MicroBatchIterator(train, sampler, tokenizer)
