"""The data pipeline of a GPT pretraining run, on megatron-core's own pieces.

* :mod:`recipes.data.tokenizers` - :class:`ByteTokenizer` (ids 0..255 are bytes, UTF-8 for text;
  256 is ``<eod>``; 257 ids), :class:`HFTokenizer` (a local Hugging Face ``tokenizer.json``) and
  :func:`build_tokenizer`.
* :mod:`recipes.data.corpus` - :func:`prepare_data`: turns ``data.source`` into Megatron
  indexed-dataset prefixes (``.bin`` + ``.idx``, written with megatron's ``IndexedDatasetBuilder``),
  cached under ``data.cache_dir``.
* :mod:`recipes.data.datasets` - :func:`build_datasets`: megatron's ``GPTDataset`` (or
  ``MockGPTDataset``) train/valid/test splits through ``BlendedMegatronDatasetBuilder``.
* :mod:`recipes.data.chat` - ``data=chat``: ``.jsonl`` conversations rendered with a Hugging Face
  tokenizer's chat template, the loss mask on the assistant turns, optionally packed
  (:func:`~recipes.data.chat.prepare_chat`, :class:`~recipes.data.chat.ChatDataset`); also from
  a directory saved with the ``datasets`` library (:mod:`recipes.data.chat_saved`).
* :mod:`recipes.data.sampler` - :func:`build_iterators` / :func:`build_train_iterator`:
  micro-batches for one data-parallel rank (and :class:`ValidationBatches`, the validation set), sampled like Megatron-LM's ``MegatronPretrainingSampler`` (see
  :class:`PretrainingSampler`), resumable from ``consumed_samples`` under any data-parallel size.

Layout under ``cache_dir``::

    pydoc_<tokenizer>-<key>/text_document.{bin,idx}  + meta.json  (source=pydoc; byte or hf)
    text_<tokenizer>-<key>/text_document.{bin,idx}   + meta.json  (source=text)
    gpt_indices/<hash>-GPTDataset-train-*.npy                (megatron's sample/shuffle indices)
    chat_<key>/{train,validation}.npz + meta.json            (source=chat)

Distributed use: :func:`build_datasets` and :func:`build_train_iterator` are collective when
``torch.distributed`` is initialized: every rank of the default group must call them (global rank 0
builds the corpus and megatron's index caches first, the others then read them). ``cache_dir`` must
therefore be on a filesystem all ranks see (as Megatron-LM's ``--data-cache-path``). Without
``torch.distributed`` everything runs in the calling process.
"""

from recipes.data.corpus import CORPUS_FORMAT_VERSION, TEXT_SUFFIXES, check_data_paths, prepare_data
from recipes.data.tokenizers import (
    NO_PAD_ID,
    SOURCES,
    TOKENIZERS,
    ByteTokenizer,
    ExternalTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)
from mcore_compat.lazy import lazy_names

# The modules that import torch are loaded on first use of one of their names (start-up time:
# train.py checks the tokenizer before launch).
_LAZY = {
    "datasets": ("build_datasets",),
    "sampler": ("BATCH_KEYS", "MicroBatchIterator", "PretrainingSampler", "ValidationBatches",
                "build_iterators", "build_train_iterator", "collate"),
}

__all__ = [
    "BATCH_KEYS",
    "CORPUS_FORMAT_VERSION",
    "NO_PAD_ID",
    "SOURCES",
    "TEXT_SUFFIXES",
    "TOKENIZERS",
    "ByteTokenizer",
    "ExternalTokenizer",
    "HFTokenizer",
    "MicroBatchIterator",
    "PretrainingSampler",
    "Tokenizer",
    "ValidationBatches",
    "build_datasets",
    "build_iterators",
    "check_data_paths",
    "build_tokenizer",
    "build_train_iterator",
    "collate",
    "prepare_data",
]

__getattr__ = lazy_names(__name__, _LAZY)
