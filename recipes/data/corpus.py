"""Corpus preparation and its cache: ``data.source`` as Megatron indexed-dataset prefixes.

:func:`prepare_data` writes ``.bin`` + ``.idx`` files with megatron's ``IndexedDatasetBuilder``
under ``data.cache_dir``; the key in each name changes whenever the input changes, so a stale
cache is never read::

    pydoc_<tokenizer>-<key>/text_document.{bin,idx}  + meta.json  (source=pydoc; byte or hf)
    text_<tokenizer>-<key>/text_document.{bin,idx}   + meta.json  (source=text)

A corpus directory is built under a temporary name and renamed into place with ``os.replace``: two
processes racing, or a crash half-way, never leave a half-written corpus behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator

import numpy

from gtp.progress import progress

from recipes.data.tokenizers import Tokenizer, build_tokenizer, check_source

TEXT_SUFFIXES = (".txt", ".jsonl")
# Bump when the way a corpus is written changes: every cached corpus is then rebuilt.
CORPUS_FORMAT_VERSION = 1
_PREFIX_NAME = "text_document"


def prepare_data(data_cfg: Any, seq_length: int) -> list[str]:
    """Megatron indexed-dataset prefixes (``<prefix>.bin`` / ``<prefix>.idx``) for ``data_cfg``.

    * ``pydoc``: CPython's ``pydoc_data.topics.topics``, one document per topic (sorted by name),
      each followed by ``eod``; built once into ``<cache_dir>/pydoc_<tokenizer>-<key>/text_document``.
    * ``text``: ``data.paths`` in the given order; a ``.txt`` file is one document (its exact bytes),
      a ``.jsonl`` line is one document (the string under ``data.jsonl_key``; blank lines skipped).
      Empty documents are skipped. Built once into ``<cache_dir>/text_<tokenizer>-<key>/text_document``,
      ``key`` hashing the absolute paths, mtimes, sizes and ``jsonl_key``.
    * ``indexed``: ``data.paths`` as given (absolute), after checking the files exist.
    * ``mock``: ``[]`` (megatron's MockGPTDataset reads no files).

    Corpora are written with uint16 ids (int32 above 65,536 tokens) and built only when missing, atomically. Safe to call from
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
    source = check_source(data_cfg)
    tokenizer = build_tokenizer(data_cfg)
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    if source == "mock":
        return []
    if source == "indexed":
        prefixes = check_indexed_paths(data_cfg)
        for prefix in prefixes:
            _check_min_tokens(prefix, seq_length, f"indexed data {prefix}")
        return prefixes

    cache_dir = resolved_cache_dir(data_cfg)
    if source == "pydoc":
        from pydoc_data.topics import topics

        names = sorted(topics)
        key = _hash_key(
            [CORPUS_FORMAT_VERSION, tokenizer.unique_identifiers]
            + [[name, topics[name]] for name in names]
        )
        out_dir = os.path.join(cache_dir, f"pydoc_{tokenizer.name}-{key}")
        inputs = {"pydoc_data.topics": f"{len(names)} topics"}

        def documents() -> Iterator[bytes]:
            for name in names:
                yield topics[name].encode("utf-8")

    else:  # text
        files = check_text_paths(data_cfg)
        stats = [os.stat(p) for p in files]
        key = _hash_key(
            [CORPUS_FORMAT_VERSION, tokenizer.unique_identifiers, data_cfg.jsonl_key]
            + [[p, s.st_mtime_ns, s.st_size] for p, s in zip(files, stats)]
        )
        out_dir = os.path.join(cache_dir, f"text_{tokenizer.name}-{key}")
        inputs = {p: {"mtime_ns": s.st_mtime_ns, "size": s.st_size} for p, s in zip(files, stats)}
        jsonl_key = data_cfg.jsonl_key

        def documents() -> Iterator[bytes]:
            for path in files:
                yield from _read_documents(path, jsonl_key)

    prefix = _build_corpus(out_dir, documents, tokenizer, source, inputs)
    _check_min_tokens(prefix, seq_length, f"the {source} corpus")
    return [prefix]


def resolved_cache_dir(data_cfg: Any) -> str:
    """``data.cache_dir`` as an absolute path (ValueError when it is empty)."""
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
        check_indexed_paths(data_cfg)
    elif data_cfg.source == "text":
        check_text_paths(data_cfg)


def check_indexed_paths(data_cfg: Any) -> list[str]:
    """``data.paths`` as absolute Megatron prefixes, after checking each has ``.bin`` and ``.idx``
    (ValueError when empty, FileNotFoundError naming the missing file)."""
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


def check_text_paths(data_cfg: Any) -> list[str]:
    """``data.paths`` as absolute text files, after checking each exists and has a suffix in
    :data:`TEXT_SUFFIXES` (ValueError / FileNotFoundError naming the bad path)."""
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
    tokenizer: Tokenizer,
    source: str,
    inputs: dict,
) -> str:
    """Write ``documents`` (each + eod) to ``<out_dir>/text_document`` unless already there."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(out_dir, _PREFIX_NAME)
    if _corpus_ready(out_dir):
        return prefix
    started = time.perf_counter()
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        tmp_prefix = os.path.join(tmp_dir, _PREFIX_NAME)
        builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=tokenizer.dtype)
        num_docs = num_tokens = skipped = 0
        eod = numpy.array([tokenizer.eod], dtype=tokenizer.dtype)
        try:
            for doc in progress(documents(), f"tokenizing {source} corpus", unit="doc"):
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
            # Printed by the one process whose copy went into place.
            print(f"> tokenized the {source} corpus into {prefix}: {num_docs} documents, "
                  f"{num_tokens} tokens in {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return prefix


def sequence_lengths(prefix: str) -> numpy.ndarray:
    """Token count of each document of the indexed dataset ``prefix`` (int64 ``[documents]``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Keep the dataset alive while copying: its __del__ closes the mmap the lengths point into.
    dataset = IndexedDataset(prefix)
    lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
    del dataset
    return lengths


def _check_min_tokens(prefix: str, seq_length: int, what: str) -> None:
    lengths = sequence_lengths(prefix)
    if lengths.size == 0 or int(lengths.sum()) < seq_length + 1:
        raise ValueError(
            f"{what} holds {int(lengths.sum())} tokens in {lengths.size} documents: too few for "
            f"one sample of model.seq_length={seq_length} (needs {seq_length + 1})"
        )
